"""The loss mask of a chat row, found by bisection at span boundaries, is exactly the per-token rule."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from data_helpers import (
    CHATML,
    CHATML_TAGGED,
    CHATML_TAGGED_TURN_THINK,
    CONVERSATIONS,
    EMPTY_REPLY,
    LAST_TURN_THINKS,
    PLAIN_TRIMMED,
    bpe_tokenizer,
)

from loralei.train.data import ChatEncoder
from loralei.train.data.spans import span_mask
from loralei.train.data.template import ChatRenderer, load_chat_template

TEXTS = [
    "<|im_start|>user\nreverse: abcd<|im_end|>\n<|im_start|>assistant\ndcba<|im_end|>\n",
    "hello world, the answer is dcba\n\naba  assistant\n\n\n",
    "x",
    "",
]


@functools.cache
def _tokenizer(kind: str):
    from data_helpers import QUICKSTART
    from transformers import AutoTokenizer

    if kind == "chars":
        return AutoTokenizer.from_pretrained(QUICKSTART / "model")
    return bpe_tokenizer(merge_newlines=kind == "bpe merging newlines")


KINDS = ["chars", "bpe", "bpe merging newlines"]


def reference_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """The per-token rule, one token at a time (what loralei did before, and Transformers' assistant mask does)."""
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(k < len(spans) and end > spans[k][0])
    return mask


def _random_spans(rng: random.Random, length: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(length + 1), k=min((length + 1) // 2 * 2, 2 * rng.randint(0, 4))))
    spans = list(zip(cuts[::2], cuts[1::2], strict=True))
    if length and rng.random() < 0.3:  # empty spans, as a generation block around nothing gives
        at = rng.randint(0, length)
        spans = sorted({*spans, (at, at)})
        spans = [s for i, s in enumerate(spans) if i == 0 or s[0] >= spans[i - 1][1]]
    return spans


@pytest.mark.parametrize("kind", KINDS)
def test_span_mask_equals_the_per_token_rule_on_random_spans(kind) -> None:
    tok, rng = _tokenizer(kind), random.Random(0)
    for text in TEXTS:
        encoding = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        assert [tuple(o) for o in encoding.offsets] == [tuple(o) for o in offsets]
        for _ in range(300):
            spans = _random_spans(rng, len(text))
            assert span_mask(encoding, spans).tolist() == reference_mask(offsets, spans), (text, spans)


@pytest.mark.parametrize(
    "template", [CHATML, CHATML_TAGGED, CHATML_TAGGED_TURN_THINK, LAST_TURN_THINKS, PLAIN_TRIMMED]
)
@pytest.mark.parametrize("kind", KINDS)
def test_chat_labels_equal_the_reference_pipeline(kind, template) -> None:
    """Text from apply_chat_template, offsets from the tokenizer call, the per-token rule (and, for tagged
    templates, Transformers' own assistant mask): the labels loralei gave before its rows went to arrays."""
    tok = _tokenizer(kind)
    renderer = ChatRenderer(load_chat_template(tok, template))
    encoder = ChatEncoder(tok, template)
    for conversation in [*CONVERSATIONS, EMPTY_REPLY]:
        text = tok.apply_chat_template(conversation, chat_template=template, tokenize=False)
        out = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = reference_mask(out["offset_mapping"], renderer.render(conversation).spans)
        if renderer.template.tagged:
            assistant = tok.apply_chat_template(
                conversation, chat_template=template, return_dict=True, return_assistant_tokens_mask=True
            )["assistant_masks"]
            mask = [m and bool(a) for m, a in zip(mask, assistant, strict=True)]
        expected = np.where(mask, out["input_ids"], -100).tolist()
        assert encoder.encode(conversation) == (list(out["input_ids"]), expected)
