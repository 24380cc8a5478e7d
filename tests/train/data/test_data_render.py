"""loralei renders chat templates itself: the text must be what apply_chat_template writes, and the spans of
{% generation %} blocks what Transformers' assistant mask covers."""

from __future__ import annotations

import pytest
from data_helpers import (
    CHATML,
    CHATML_TAGGED,
    CHATML_TAGGED_CONTENT,
    CHATML_TAGGED_TURN,
    CHATML_TAGGED_TURN_THINK,
    CONVERSATIONS,
    EMPTY_REPLY,
    LAST_TURN_THINKS,
    PLAIN_TRIMMED,
    STRICT,
    bpe_tokenizer,
)

from loralei.train.data.render import TemplateRenderer
from loralei.train.data.spans import span_mask

# What real templates use that the small ones above do not: a namespace, loop controls, tojson, dict(), the
# special-token variables, a system prompt pulled out of the list, reasoning and tool calls.
RICH = (
    "{{- bos_token if bos_token is defined else '' }}"
    "{%- set ns = namespace(system='', turns=0) %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = m.content %}{%- endif %}{%- endfor %}"
    "{%- if ns.system %}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{% continue %}{%- endif %}"
    "{%- set ns.turns = ns.turns + 1 %}"
    "{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>' + m.reasoning_content + '</think>\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- if m.tool_calls %}{{- '\\n' + (m.tool_calls | tojson) }}{%- endif %}"
    "{{- '<|im_end|>' + eos_token + '\\n' if loop.last else '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- else %}{{- dict(turns=ns.turns) | tojson }}{%- endif %}"
)
RICH_CONVERSATION = [
    {"role": "system", "content": "be brief <|im_end|> & <tags>"},
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "cba", "reasoning": "read it backwards"},
    {"role": "user", "content": 'and "é"?'},
    {"role": "assistant", "content": "é", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
]
TEMPLATES = {
    "chatml": CHATML,
    "tagged": CHATML_TAGGED,
    "tagged-content": CHATML_TAGGED_CONTENT,
    "tagged-turn": CHATML_TAGGED_TURN,
    "tagged-think": CHATML_TAGGED_TURN_THINK,
    "last-turn-thinks": LAST_TURN_THINKS,
    "plain-trimmed": PLAIN_TRIMMED,
    "strict": STRICT,
    "rich": RICH,
}
CHATS = [*CONVERSATIONS, EMPTY_REPLY, RICH_CONVERSATION]


def _prefixes(conversation: list[dict]) -> list[list[dict]]:
    return [conversation[:n] for n in range(1, len(conversation) + 1)]


@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
def test_text_is_what_apply_chat_template_writes(tokenizer, template) -> None:
    renderer = TemplateRenderer(template, tokenizer.special_tokens_map)
    for conversation in (p for chat in CHATS for p in _prefixes(chat)):
        for generation_prompt in (False, True):
            try:
                expected = tokenizer.apply_chat_template(
                    conversation,
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=generation_prompt,
                )
            except Exception as err:  # the template rejects it: so must the renderer
                with pytest.raises(type(err)):
                    renderer.render(conversation, generation_prompt)
                continue
            assert renderer.render(conversation, generation_prompt) == expected


def test_the_quickstart_tokenizers_own_template(tokenizer) -> None:
    renderer = TemplateRenderer(tokenizer.chat_template, tokenizer.special_tokens_map)
    for conversation in CHATS:
        assert renderer.render(conversation) == tokenizer.apply_chat_template(conversation, tokenize=False)


@pytest.mark.parametrize(
    "template", [CHATML_TAGGED, CHATML_TAGGED_CONTENT, CHATML_TAGGED_TURN, CHATML_TAGGED_TURN_THINK]
)
@pytest.mark.parametrize("make_tokenizer", ["chars", "bpe"])
def test_generation_spans_give_transformers_assistant_mask(tokenizer, template, make_tokenizer) -> None:
    tok = tokenizer if make_tokenizer == "chars" else bpe_tokenizer()
    renderer = TemplateRenderer(template, tok.special_tokens_map)
    for conversation in CHATS:
        text, spans = renderer.render_tracked(conversation)
        assert text == renderer.render(conversation)
        out = tok.apply_chat_template(
            conversation, chat_template=template, return_dict=True, return_assistant_tokens_mask=True
        )
        encoding = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        assert encoding.ids == out["input_ids"]
        assert span_mask(encoding, spans).astype(int).tolist() == out["assistant_masks"]


def test_the_sandbox_keeps_templates_away_from_python_internals(tokenizer) -> None:
    from jinja2.exceptions import SecurityError

    for template in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace() %}{% set ns._x = 1 %}"):
        with pytest.raises(SecurityError):
            TemplateRenderer(template, {}).render([])
