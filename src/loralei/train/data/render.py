"""Rendering a chat template to text, as Transformers' ``apply_chat_template(..., tokenize=False)`` does.

``apply_chat_template`` costs about 0.1 ms a call in argument checks and copies around a 30 µs Jinja render, and a
conversation is rendered once plus once per assistant turn (to find where each turn starts): at 100,000 rows that
overhead alone is half a minute. This renders with the same Jinja settings (a sandboxed environment that trims
blocks, ``loopcontrols``, ``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``, a guarded
``namespace`` and ``dict``, the tokenizer's special tokens as variables) and records the character spans of
``{% generation %}`` blocks the way Transformers does for its assistant mask. The tests compare the text with
``apply_chat_template`` for every template they use.

Nothing here imports Transformers or torch: tokenization workers render too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; Transformers fills the first and ``thinking`` from any of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlocks(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body and, while a recording is on, notes the
    body's ``(start, end)`` character span in the output written so far."""

    tags = {"generation"}  # noqa: RUF012 (Jinja reads this class attribute)

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.recording: tuple[list[int], list[tuple[int, int]]] | None = None

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller: Any) -> str:
        text = caller()
        if self.recording is not None:
            written, spans = self.recording
            spans.append((written[0], written[0] + len(text)))
        return text


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses underscore-prefixed names (no way towards CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick: any name may be a key
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r}")


class _Dict:
    """The template's ``dict``: builds plain dicts, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False
):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _with_reasoning_aliases(messages: Iterable[dict]) -> list[dict]:
    """Fills ``reasoning_content`` and ``thinking`` from whichever reasoning field a message has (what templates
    read, under either name), as Transformers does."""
    out = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class TemplateRenderer:
    """A compiled chat template and the variables it is rendered with.

    Args:
        template: the Jinja source.
        variables: extra template variables, the tokenizer's special tokens (``eos_token``, ``bos_token``, ...).

    Raises:
        jinja2.TemplateError: the template does not compile.
    """

    def __init__(self, template: str, variables: dict[str, Any]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(
            raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace
        )
        self._tracker = next(e for e in env.extensions.values() if isinstance(e, _GenerationBlocks))
        self._template = env.from_string(template)
        self._variables = dict(variables)

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        """The conversation as text; with ``generation_prompt`` the header of the next assistant turn follows."""
        return self._template.render(self._context(messages, generation_prompt))

    def render_tracked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text, and the character spans of its ``{% generation %}`` blocks."""
        written, spans, pieces = [0], [], []
        self._tracker.recording = (written, spans)
        try:
            for piece in self._template.generate(self._context(messages, False)):
                pieces.append(piece)
                written[0] += len(piece)
        finally:
            self._tracker.recording = None
        return "".join(pieces), spans

    def _context(self, messages: list[dict], generation_prompt: bool) -> dict[str, Any]:
        return {
            **self._variables,
            "messages": _with_reasoning_aliases(messages),
            "tools": None,
            "documents": None,
            "add_generation_prompt": generation_prompt,
        }
