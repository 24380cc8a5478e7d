"""Chat templates: render a conversation and label only the assistant turns (with their end-of-turn token).

The mask is found in the rendered text: each assistant turn starts where the template's generation prompt for that
turn ends (rendering the conversation up to it with ``add_generation_prompt=True``), its content is located from
there, and the span runs through the first end-of-turn token after it. Tokens whose character offsets overlap a
span are trained. This needs no cooperation from the template and copes with templates that render a turn
differently when it is the last one (the prefix check simply falls back to an ordered search of the contents).

Templates with ``{% generation %}`` blocks are masked the same way, and a token is trained only if Transformers'
assistant mask (the tokens the blocks cover) has it too: the blocks can narrow the mask, e.g. to the content
without its end-of-turn token, but not widen it, so a block around a whole turn trains neither its role header
nor the whitespace after its end-of-turn token.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import DataError

IGNORE_INDEX = -100
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = ("loralei-probe-user", "loralei-probe-assistant")


class DropRow(Exception):  # a control-flow signal, not an error shown to users
    """Raised while encoding a row to drop it; ``args[0]`` is the reason counted in the summary."""


def resolve_chat_template(tokenizer, chat_template: str | None) -> str:
    """Returns the Jinja template to use: the configured one (a template string or a file path) or the tokenizer's.

    Args:
        tokenizer: a Transformers tokenizer.
        chat_template: ``data.chat_template``: a Jinja string, a path to a ``.jinja`` file, or None.

    Returns:
        The template source.

    Raises:
        DataError: no template is configured and the tokenizer has none, or the configured file is missing.
    """
    if chat_template is not None:
        looks_like_path = "{" not in chat_template and "\n" not in chat_template
        if looks_like_path:
            path = Path(chat_template).expanduser()
            if not path.is_file():
                raise DataError(
                    f"data.chat_template: {chat_template!r} is neither a Jinja template nor an existing file"
                )
            return path.read_text()
        return chat_template
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one renders plain conversations
        template = template.get("default")
    if not template:
        raise DataError(
            "data.chat_template: the tokenizer has no chat template and none is configured; set "
            "data.chat_template to a Jinja template string or a .jinja file (e.g. the base model's instruct template)"
        )
    return template


def _special_strings(tokenizer) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    specials.update(tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special)
    return sorted(specials, key=len, reverse=True)


class ChatEncoder:
    """Tokenizes conversations with a chat template and labels the assistant tokens.

    Args:
        tokenizer: a fast Transformers tokenizer (character offsets are needed).
        chat_template: the configured template or None for the tokenizer's own.

    Raises:
        DataError: no usable template, or a slow tokenizer.
    """

    def __init__(self, tokenizer, chat_template: str | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                "model.tokenizer: loss masking needs a fast tokenizer (character offsets); load it with use_fast=True"
            )
        self.tokenizer = tokenizer
        self.template = resolve_chat_template(tokenizer, chat_template)
        self.tagged = bool(GENERATION_TAG.search(self.template))
        self.end_of_turn, self.closing = self._probe_turn_end()

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _probe_turn_end(self) -> tuple[str, str]:
        """Finds what the template writes after an assistant message: its end-of-turn token and closing text."""
        user, assistant = _PROBE
        try:
            text = self._render(
                [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            )
        except Exception as err:
            raise DataError(
                f"data.chat_template: rendering a user/assistant exchange failed: {err}"
            ) from None
        if assistant not in text:
            raise DataError("data.chat_template: the template does not write the assistant message's content")
        closing = text[text.rindex(assistant) + len(assistant) :]
        found = [(closing.find(tok), tok) for tok in _special_strings(self.tokenizer) if tok in closing]
        end_of_turn = min(found)[1] if found else ""
        return end_of_turn, closing.rstrip()

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Tokenizes one conversation.

        Args:
            messages: ``[{"role": ..., "content": str}, ...]`` with roles already normalised.

        Returns:
            ``(input_ids, labels)``; labels are ``-100`` outside the assistant turns.

        Raises:
            DropRow: the template rejects the conversation or does not write an assistant message's content.
        """
        try:
            ids, labels = self._encode_by_offsets(messages)
            if self.tagged:
                labels = self._inside_generation_blocks(messages, labels)
            return ids, labels
        except DropRow:
            raise
        except Exception as err:  # a template's raise_exception(...) or a rendering failure rejects the row
            raise DropRow("rejected by template") from err

    def _inside_generation_blocks(self, messages: list[dict], labels: list[int]) -> list[int]:
        """Keeps the labels of the tokens that the template's generation blocks cover (same text, same tokens)."""
        out = self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, return_dict=True, return_assistant_tokens_mask=True
        )
        return [t if m else IGNORE_INDEX for t, m in zip(labels, out["assistant_masks"], strict=True)]

    def _encode_by_offsets(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        text = self._render(messages)
        spans = self._assistant_spans(text, messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        labels, k = [], 0
        for token, (start, end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            inside = k < len(spans) and end > spans[k][0]
            labels.append(token if inside else IGNORE_INDEX)
        return list(enc["input_ids"]), labels

    def _assistant_spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of the assistant turns in ``text``, in order."""
        located: list[tuple[int, int, bool]] = []
        cursor = 0
        for i, msg in enumerate(messages):
            content, is_assistant = msg["content"], msg["role"] == "assistant"
            if not content:
                continue  # nothing to locate (e.g. a tool-call turn); such a turn is not trained
            if is_assistant:
                cursor = max(cursor, self._turn_start(text, messages[:i]))
            start, length = _locate(text, content, cursor)
            if start < 0:
                if is_assistant:
                    raise DropRow("assistant content not found in template output")
                continue  # templates may drop or move e.g. a system message
            located.append((start, start + length, is_assistant))
            cursor = start + length
        spans = []
        for i, (start, end, is_assistant) in enumerate(located):
            if is_assistant:
                limit = located[i + 1][0] if i + 1 < len(located) else len(text)
                spans.append((start, self._turn_end(text, end, limit)))
        return spans

    def _turn_start(self, text: str, history: list[dict]) -> int:
        """Where the assistant turn after ``history`` starts, if the template renders prefixes consistently."""
        if not history:
            return 0
        prompt = self._render(history, generation_prompt=True)
        return len(prompt) if text.startswith(prompt) else 0

    def _turn_end(self, text: str, content_end: int, limit: int) -> int:
        """End of an assistant turn: through its end-of-turn token, else through the template's closing text."""
        if self.end_of_turn:
            found = text.find(self.end_of_turn, content_end, limit)
            if found >= 0:
                return found + len(self.end_of_turn)
        if self.closing and text.startswith(self.closing, content_end):
            return content_end + len(self.closing)
        return content_end


def _locate(text: str, content: str, cursor: int) -> tuple[int, int]:
    """Finds a message's content at or after ``cursor``; templates often strip it, so try that too."""
    for candidate in (content, content.strip()):
        if candidate:
            found = text.find(candidate, cursor)
            if found >= 0:
                return found, len(candidate)
    return -1, 0
