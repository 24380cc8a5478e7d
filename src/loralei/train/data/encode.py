"""Turning one raw row into ``input_ids`` and ``labels`` (``-100`` = no loss), or a reason to drop it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .formats import RowFormat
from .template import IGNORE_INDEX, ChatEncoder, DropRow

# Part of the datasets.map cache key (the encoder is hashed by value, its code by name only): bump it whenever
# the encoding of a row changes, so stale cached tokenizations are not reused.
ENCODING_VERSION = 2
EMPTY, MALFORMED, NO_TRAINABLE, TOO_LONG = "empty", "malformed", "no trainable token", "too long"
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

Encoded = tuple[list[int], list[int]]


def normalize_messages(value: Any) -> list[dict]:
    """Checks a conversation and maps it to ``[{"role", "content", ...}]`` with standard role names.

    Args:
        value: a list of ``{role, content}`` or ShareGPT ``{from, value}`` dicts.

    Returns:
        The messages; keys other than the role/content pair are kept when set (e.g. ``tool_calls``).

    Raises:
        DropRow: the conversation is empty or malformed.
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


def _text(value: Any) -> str:
    if value is None or value == "":
        raise DropRow(EMPTY)
    if not isinstance(value, str):
        raise DropRow(MALFORMED)
    return value


@dataclass
class RowEncoder:
    """Encodes rows of one format; called by ``datasets.map`` (picklable, so ``num_proc`` works).

    Attributes:
        fmt: the row format and its columns.
        tokenizer: a Transformers tokenizer.
        chat: the chat encoder, for formats that use the chat template (None otherwise).
        max_seq_length: longest kept row, in tokens.
        truncate: cut longer rows to ``max_seq_length`` instead of dropping them.
        encoding_version: see ``ENCODING_VERSION``.
    """

    fmt: RowFormat
    tokenizer: Any
    chat: ChatEncoder | None
    max_seq_length: int
    truncate: bool
    encoding_version: int = ENCODING_VERSION

    def __call__(self, row: dict) -> dict:
        """Returns ``input_ids``, ``labels``, ``dropped`` (a reason, "" when kept) and ``truncated``."""
        try:
            ids, labels = ENCODERS[self.fmt.kind](self, row)
            ids, labels, truncated = self._fit(ids, labels)
        except DropRow as drop:
            return {"input_ids": [], "labels": [], "dropped": drop.args[0], "truncated": False}
        return {"input_ids": ids, "labels": labels, "dropped": "", "truncated": truncated}

    def _fit(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int], bool]:
        if not ids:
            raise DropRow(EMPTY)
        # The first token is never predicted; masking it also stops a packed sample from being trained to
        # predict its first token from the previous sample's last one.
        labels = [IGNORE_INDEX, *labels[1:]]
        truncated = len(ids) > self.max_seq_length
        if truncated and not self.truncate:
            raise DropRow(TOO_LONG)
        ids, labels = ids[: self.max_seq_length], labels[: self.max_seq_length]
        if all(label == IGNORE_INDEX for label in labels):
            raise DropRow(NO_TRAINABLE)
        return ids, labels, truncated

    def _tokens(self, text: str, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _with_eos(self, ids: list[int]) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else ids

    def chat_row(self, messages: list[dict]) -> Encoded:
        """Encodes a normalised conversation with the chat template (built for every chat-rendering format)."""
        return self.chat.encode(messages)


def _encode_messages(enc: RowEncoder, row: dict) -> Encoded:
    return enc.chat_row(normalize_messages(row[enc.fmt.columns["messages"]]))


def _encode_instruction(enc: RowEncoder, row: dict) -> Encoded:
    cols = enc.fmt.columns
    prompt = _text(row[cols["instruction"]])
    extra = row.get(cols["input"]) if "input" in cols else None
    if extra:
        prompt = f"{prompt}\n\n{_text(extra)}"
    turns = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": _text(row[cols["response"]])},
    ]
    return enc.chat_row(turns)


def _encode_prompt_completion(enc: RowEncoder, row: dict) -> Encoded:
    prompt, completion = row[enc.fmt.columns["prompt"]], row[enc.fmt.columns["completion"]]
    if isinstance(prompt, list) or isinstance(completion, list):  # conversational prompt/completion
        return enc.chat_row(normalize_messages((prompt or []) + (completion or [])))
    prompt_ids = enc._tokens(_text(prompt), special=True)
    completion_ids = enc._with_eos(enc._tokens(_text(completion), special=False))
    return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def _encode_text(enc: RowEncoder, row: dict) -> Encoded:
    ids = enc._with_eos(enc._tokens(_text(row[enc.fmt.columns["text"]]), special=True))
    return ids, list(ids)


def _int_list(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise DropRow(MALFORMED)
    return value


def _encode_pretokenized(enc: RowEncoder, row: dict) -> Encoded:
    ids = _int_list(row["input_ids"])
    labels = _int_list(row["labels"]) if row.get("labels") is not None else list(ids)
    mask = _int_list(row["attention_mask"]) if row.get("attention_mask") is not None else [1] * len(ids)
    if not len(ids) == len(labels) == len(mask):
        raise DropRow(MALFORMED)
    if any(not 0 <= t < len(enc.tokenizer) for t in ids):
        raise DropRow("token id outside the vocabulary")
    keep = [i for i, m in enumerate(mask) if m]  # attention_mask 0 marks padding: not part of the sample
    return [ids[i] for i in keep], [labels[i] for i in keep]


ENCODERS: dict[str, Callable[[RowEncoder, dict], Encoded]] = {
    "messages": _encode_messages,
    "instruction": _encode_instruction,
    "prompt_completion": _encode_prompt_completion,
    "text": _encode_text,
    "pretokenized": _encode_pretokenized,
}
