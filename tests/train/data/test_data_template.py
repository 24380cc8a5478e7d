"""Loss masks from chat templates: only assistant turns and their end-of-turn token are trained."""

from __future__ import annotations

import copy

import pytest
from data_helpers import CHATML, bpe_tokenizer, trained_text

from loralei.train.data import ChatEncoder, DataError
from loralei.train.data.template import DropRow

# The same ChatML rendering with {% generation %} blocks: Transformers' own assistant mask is the reference.
CHATML_TAGGED = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Like Qwen3: the last assistant turn gets an (untrained) empty think block, earlier ones do not.
LAST_TURN_THINKS = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# No special tokens at all, and the template trims what it writes.
PLAIN_TRIMMED = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}Q: {{ m.content | trim }}\n{% else %}A: {{ m.content | trim }}\n\n{% endif %}"
    "{% endfor %}"
    "{%- if add_generation_prompt %}A: {% endif %}"
)
STRICT = (
    "{%- for m in messages %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "reverse: abcd"}, {"role": "assistant", "content": "dcba"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse: aba"},
        {"role": "assistant", "content": "aba"},
        {"role": "user", "content": "again: assistant"},
        {"role": "assistant", "content": "assistant"},
    ],
]


def test_chatml_masks_assistant_content_and_end_of_turn(tokenizer) -> None:
    ids, labels = ChatEncoder(tokenizer).encode(CONVERSATIONS[1])
    assert (
        trained_text(tokenizer, {"input_ids": ids, "labels": labels}) == "aba<|im_end|>§assistant<|im_end|>"
    )
    # The answer "aba" also occurs in the user turn and "assistant" in every header: the right copies are trained.
    text = tokenizer.decode(ids)
    first = next(i for i, label in enumerate(labels) if label != -100)
    assert tokenizer.decode(ids[:first]).endswith("reverse: aba<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("aba") == 2


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("make_tokenizer", ["chars", "bpe"])
def test_offsets_mask_equals_generation_tag_mask(tokenizer, conversation, make_tokenizer) -> None:
    tok = tokenizer if make_tokenizer == "chars" else bpe_tokenizer()
    plain = ChatEncoder(tok, CHATML)
    tagged = ChatEncoder(tok, CHATML_TAGGED)
    assert not plain.tagged and tagged.tagged
    assert plain.encode(conversation) == tagged.encode(conversation)


def test_last_turn_rendered_differently(tokenizer) -> None:
    enc = ChatEncoder(tokenizer, LAST_TURN_THINKS)
    ids, labels = enc.encode(CONVERSATIONS[1])
    assert "<think>" in tokenizer.decode(ids)
    assert (
        trained_text(tokenizer, {"input_ids": ids, "labels": labels}) == "aba<|im_end|>§assistant<|im_end|>"
    )


def test_template_without_special_tokens_trains_stripped_content(tokenizer) -> None:
    enc = ChatEncoder(tokenizer, PLAIN_TRIMMED)
    conversation = [{"role": "user", "content": "reverse: ab "}, {"role": "assistant", "content": "  ba\n"}]
    ids, labels = enc.encode(conversation)
    assert tokenizer.decode(ids) == "Q: reverse: ab\nA: ba\n\n"
    assert trained_text(tokenizer, {"input_ids": ids, "labels": labels}) == "ba"


def test_template_rejecting_a_conversation_drops_the_row(tokenizer) -> None:
    enc = ChatEncoder(tokenizer, STRICT)
    assert enc.encode(CONVERSATIONS[0])[0]
    with pytest.raises(DropRow, match="rejected by template"):
        enc.encode([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(tokenizer) -> None:
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DataError, match=r"data\.chat_template: the tokenizer has no chat template"):
        ChatEncoder(bare)
    assert ChatEncoder(bare, CHATML).encode(CONVERSATIONS[0])[0]


def test_chat_template_from_file(tokenizer, tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(LAST_TURN_THINKS)
    assert ChatEncoder(tokenizer, str(path)).template == LAST_TURN_THINKS
    with pytest.raises(DataError, match="neither a Jinja template nor an existing file"):
        ChatEncoder(tokenizer, str(tmp_path / "missing.jinja"))
