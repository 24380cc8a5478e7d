"""Chat templates: render a conversation and find the text to train, the assistant turns with their end of turn.

The mask is found in the rendered text: each assistant turn starts where the template's generation prompt for that
turn ends (rendering the conversation up to it with ``add_generation_prompt=True``), its content is located from
there, and the span runs through the first end-of-turn token after it. Tokens whose character offsets overlap a
span are trained (``spans.py``). This needs no cooperation from the template and copes with templates that render a
turn differently when it is the last one (the prefix check simply falls back to an ordered search of the contents).

Templates with ``{% generation %}`` blocks are masked the same way, and a token is trained only if it also overlaps
a generation block (Transformers' assistant mask): the blocks can narrow the mask, e.g. to the content without its
end-of-turn token, but not widen it, so a block around a whole turn trains neither its role header nor the
whitespace after its end-of-turn token.

``ChatTemplate`` is plain data (built and checked once, in the main process); ``ChatRenderer`` renders with it in
any process; ``ChatEncoder`` tokenizes one conversation with a Transformers tokenizer.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError
from .render import TemplateRenderer
from .spans import Span, span_mask

IGNORE_INDEX = -100
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = ("loralei-probe-user", "loralei-probe-assistant")
REJECTED, NOT_FOUND = "rejected by template", "assistant content not found in template output"


class DropRow(Exception):  # a control-flow signal, not an error shown to users
    """Raised while encoding a row to drop it; ``args[0]`` is the reason counted in the summary."""


def resolve_chat_template(tokenizer: Any, chat_template: str | None) -> str:
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
        if _looks_like_path(chat_template):
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


def template_identity(tokenizer: Any, chat_template: str | None) -> Any:
    """What decides the chat template, for the token cache's key; never raises (a missing file is keyed by name)."""
    if chat_template is None:
        return tokenizer.chat_template
    path = Path(chat_template).expanduser()
    return path.read_text() if _looks_like_path(chat_template) and path.is_file() else chat_template


def _looks_like_path(chat_template: str) -> bool:
    return "{" not in chat_template and "\n" not in chat_template


def _special_strings(tokenizer: Any) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    specials.update(tok.content for tok in tokenizer.added_tokens_decoder.values() if tok.special)
    return sorted(specials, key=len, reverse=True)


@dataclass(frozen=True)
class ChatTemplate:
    """A checked chat template and what its assistant turns end with (plain data: it travels to workers as JSON).

    Attributes:
        source: the Jinja template.
        variables: the tokenizer's special tokens, passed to the template as Transformers does.
        end_of_turn: the special token the template writes after an assistant message ("" if none).
        closing: all the template writes after an assistant message, right-stripped.
    """

    source: str
    variables: dict[str, Any]
    end_of_turn: str
    closing: str

    @property
    def tagged(self) -> bool:
        """Whether the template marks assistant text with ``{% generation %}`` blocks."""
        return bool(GENERATION_TAG.search(self.source))

    def to_json(self) -> dict[str, Any]:
        """The template as a JSON-able dict (``ChatTemplate(**d)`` rebuilds it)."""
        return asdict(self)


def load_chat_template(tokenizer: Any, chat_template: str | None = None) -> ChatTemplate:
    """Resolves the template and finds how an assistant turn ends by rendering a probe exchange.

    Args:
        tokenizer: a fast Transformers tokenizer (character offsets are needed).
        chat_template: the configured template or None for the tokenizer's own.

    Returns:
        The checked template.

    Raises:
        DataError: a slow tokenizer, no usable template, or a template that fails on (or hides) a plain exchange.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "model.tokenizer: loss masking needs a fast tokenizer (character offsets); load it with use_fast=True"
        )
    source = resolve_chat_template(tokenizer, chat_template)
    user, assistant = _PROBE
    try:
        renderer = TemplateRenderer(source, dict(tokenizer.special_tokens_map))
        text = renderer.render(
            [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        )
    except Exception as err:
        raise DataError(f"data.chat_template: rendering a user/assistant exchange failed: {err}") from None
    if assistant not in text:
        raise DataError("data.chat_template: the template does not write the assistant message's content")
    closing = text[text.rindex(assistant) + len(assistant) :]
    found = [(closing.find(tok), tok) for tok in _special_strings(tokenizer) if tok in closing]
    end_of_turn = min(found)[1] if found else ""
    return ChatTemplate(source, dict(tokenizer.special_tokens_map), end_of_turn, closing.rstrip())


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation and the character spans to train (``generation`` only for tagged templates)."""

    text: str
    spans: list[Span]
    generation: list[Span] | None


class ChatRenderer:
    """Renders conversations with a ``ChatTemplate`` and finds their assistant spans."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.renderer = TemplateRenderer(template.source, template.variables)

    def render(self, messages: list[dict]) -> RenderedChat:
        """Renders one conversation (roles already normalised).

        Raises:
            DropRow: the template rejects the conversation or does not write an assistant message's content.
        """
        try:
            if self.template.tagged:
                text, generation = self.renderer.render_tracked(messages)
            else:
                text, generation = self.renderer.render(messages), None
            return RenderedChat(text, self._assistant_spans(text, messages), generation)
        except DropRow:
            raise
        except Exception as err:  # a template's raise_exception(...) or a rendering failure rejects the row
            raise DropRow(REJECTED) from err

    def _assistant_spans(self, text: str, messages: list[dict]) -> list[Span]:
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
                    raise DropRow(NOT_FOUND)
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
        prompt = self.renderer.render(history, generation_prompt=True)
        return len(prompt) if text.startswith(prompt) else 0

    def _turn_end(self, text: str, content_end: int, limit: int) -> int:
        """End of an assistant turn: through its end-of-turn token, else through the template's closing text."""
        end_of_turn, closing = self.template.end_of_turn, self.template.closing
        if end_of_turn:
            found = text.find(end_of_turn, content_end, limit)
            if found >= 0:
                return found + len(end_of_turn)
        if closing and text.startswith(closing, content_end):
            return content_end + len(closing)
        return content_end


def _locate(text: str, content: str, cursor: int) -> tuple[int, int]:
    """Finds a message's content at or after ``cursor``; templates often strip it, so try that too."""
    for candidate in (content, content.strip()):
        if candidate:
            found = text.find(candidate, cursor)
            if found >= 0:
                return found, len(candidate)
    return -1, 0


def chat_mask(encoding: Any, chat: RenderedChat) -> np.ndarray:
    """Which tokens of the encoded ``chat.text`` are trained: inside an assistant span (and a generation block)."""
    mask = span_mask(encoding, chat.spans)
    if chat.generation is not None:
        mask &= span_mask(encoding, chat.generation)
    return mask


class ChatEncoder:
    """Tokenizes conversations with a chat template and labels the assistant tokens, one at a time.

    Args:
        tokenizer: a fast Transformers tokenizer (character offsets are needed).
        chat_template: the configured template or None for the tokenizer's own.

    Raises:
        DataError: no usable template, or a slow tokenizer.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        from .backend import TokenizerSpec

        self.chat = load_chat_template(tokenizer, chat_template)
        self.template, self.tagged = self.chat.source, self.chat.tagged
        self.renderer = ChatRenderer(self.chat)
        self.backend = TokenizerSpec.of(tokenizer).build()

    def encode(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Tokenizes one conversation.

        Args:
            messages: ``[{"role": ..., "content": str}, ...]`` with roles already normalised.

        Returns:
            ``(input_ids, labels)``; labels are ``-100`` outside the assistant turns.

        Raises:
            DropRow: the template rejects the conversation or does not write an assistant message's content.
        """
        chat = self.renderer.render(messages)
        encoding = self.backend.encode(chat.text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        return ids.tolist(), np.where(chat_mask(encoding, chat), ids, IGNORE_INDEX).tolist()
