"""Helpers shared by the data-pipeline tests."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "examples" / "quickstart"

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# ChatML with {% generation %} blocks around each assistant message's content and end-of-turn token.
CHATML_TAGGED = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Only the content is tagged: the end-of-turn token stays untrained, as the template asks.
CHATML_TAGGED_CONTENT = CHATML_TAGGED.replace(
    "{{- message['content'] + '<|im_end|>' }}{% endgeneration %}",
    "{{- message['content'] }}{% endgeneration %}{{- '<|im_end|>' }}",
)
# Like a revision of SmolLM3's template: the block wraps the whole assistant turn, role header and the newline
# after the end-of-turn token included.
CHATML_TAGGED_TURN = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- '<|im_start|>assistant\\n' + message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same with an empty think block in the tagged header (SmolLM3 with reasoning off).
CHATML_TAGGED_TURN_THINK = CHATML_TAGGED_TURN.replace(
    "'<|im_start|>assistant\\n' + message", "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n' + message"
)
# Removing the tags from a template gives its untagged twin.
GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")
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
EMPTY_REPLY = [
    {"role": "user", "content": "reverse: abcd"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "dcba"},
]


def chat(user: str, assistant: str) -> dict:
    """One user/assistant exchange in the messages format."""
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def trained_text(tokenizer, sample: dict) -> str:
    """The decoded tokens that carry a loss, with '§' between runs of consecutive trained tokens."""
    pieces, last = [], None
    for i, (token, label) in enumerate(zip(sample["input_ids"], sample["labels"], strict=True)):
        if label == -100:
            continue
        assert label == token
        if last is not None and i != last + 1:
            pieces.append("§")
        pieces.append(tokenizer.decode([token]))
        last = i
    return "".join(pieces)


def bpe_tokenizer(template: str = CHATML, merge_newlines: bool = False):
    """A small byte-level BPE tokenizer (multi-character tokens) with the ChatML special tokens.

    With ``merge_newlines`` text is not split into words first and a newline merges with the word after it, so
    tokens such as newline + "dcba" straddle the newline that ends a ChatML role header and the reply after it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not merge_newlines)
    tok.decoder = decoders.ByteLevel()
    corpus = ["reverse the word abcd", "user assistant system", "hello world, the answer is dcba"]
    if merge_newlines:
        corpus += ["\ndcba\n", "\naba\n"]
    corpus *= 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=specials[0], eos_token=specials[2], chat_template=template
    )
