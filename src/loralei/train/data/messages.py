"""Why a row is dropped (the reasons the token cache stores), and conversations checked and mapped to standard
role names; shared by the SFT row encoder and preference rows."""

from __future__ import annotations

from typing import Any

from .template import NOT_FOUND, REJECTED, DropRow

EMPTY, MALFORMED, NO_TRAINABLE, TOO_LONG = "empty", "malformed", "no trainable token", "too long"
OUTSIDE_VOCABULARY = "token id outside the vocabulary"
IDENTICAL = "chosen and rejected are identical"  # preference pairs only
# Every reason a row is dropped for; a row's reason is stored as its position here + 1 (0: kept). Append only.
REASONS = (EMPTY, MALFORMED, NO_TRAINABLE, TOO_LONG, OUTSIDE_VOCABULARY, REJECTED, NOT_FOUND, IDENTICAL)
# Chat roles under their usual names; ShareGPT's human/gpt are mapped to user/assistant.
ROLE_NAMES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "tool": "tool",
}
_KEY_PAIRS = (("role", "content"), ("from", "value"))


def normalize_messages(value: Any) -> list[dict]:
    """Checks a conversation and maps it to ``[{"role", "content", ...}]`` with standard role names.

    Args:
        value: a list of ``{role, content}`` or ShareGPT ``{from, value}`` dicts.

    Returns:
        The messages; keys other than the role/content pair are kept when set (e.g. ``tool_calls``).

    Raises:
        DropRow: the conversation is empty or malformed, or has no assistant message.
    """
    if value is None or (isinstance(value, list) and not value):
        raise DropRow(EMPTY)
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise DropRow(MALFORMED)
    out = []
    for msg in value:
        pair = next((p for p in _KEY_PAIRS if msg.get(p[0]) is not None and msg.get(p[1]) is not None), None)
        if pair is None or msg[pair[0]] not in ROLE_NAMES or not isinstance(msg[pair[1]], str):
            raise DropRow(MALFORMED)
        extra = {k: v for k, v in msg.items() if v is not None and k not in (*_KEY_PAIRS[0], *_KEY_PAIRS[1])}
        out.append({"role": ROLE_NAMES[msg[pair[0]]], "content": msg[pair[1]], **extra})
    if not any(m["role"] == "assistant" for m in out):
        raise DropRow(NO_TRAINABLE)
    return out
