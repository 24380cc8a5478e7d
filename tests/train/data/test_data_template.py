"""Loss masks from chat templates: only assistant turns and their end-of-turn token are trained."""

from __future__ import annotations

import copy
import functools

import pytest
from data_helpers import (
    CHATML,
    CHATML_TAGGED,
    CHATML_TAGGED_CONTENT,
    CHATML_TAGGED_TURN,
    CHATML_TAGGED_TURN_THINK,
    CONVERSATIONS,
    EMPTY_REPLY,
    GENERATION_TAGS,
    LAST_TURN_THINKS,
    PLAIN_TRIMMED,
    STRICT,
    bpe_tokenizer,
    trained_text,
)

from loralei.train.data import ChatEncoder, DataError
from loralei.train.data.template import DropRow


@functools.cache
def _bpe(merge_newlines: bool):
    return bpe_tokenizer(merge_newlines=merge_newlines)


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


@pytest.mark.parametrize(
    "conversation", [*CONVERSATIONS, EMPTY_REPLY], ids=["one-turn", "two-turns", "empty"]
)
@pytest.mark.parametrize(
    "template", [CHATML_TAGGED, CHATML_TAGGED_TURN, CHATML_TAGGED_TURN_THINK], ids=["reply", "turn", "think"]
)
@pytest.mark.parametrize("make_tokenizer", ["chars", "bpe", "bpe merging newlines"])
def test_generation_tags_train_what_the_untagged_twin_trains(
    tokenizer, template, conversation, make_tokenizer
) -> None:
    tok = tokenizer if make_tokenizer == "chars" else _bpe(make_tokenizer == "bpe merging newlines")
    tagged = ChatEncoder(tok, template)
    plain = ChatEncoder(tok, GENERATION_TAGS.sub("", template))
    assert tagged.tagged and not plain.tagged
    assert tagged.encode(conversation) == plain.encode(conversation)


@pytest.mark.parametrize("template", [CHATML_TAGGED_TURN, CHATML_TAGGED_TURN_THINK], ids=["turn", "think"])
def test_tagged_role_header_and_trailing_newline_are_not_trained(tokenizer, template) -> None:
    enc = ChatEncoder(tokenizer, template)
    ids, labels = enc.encode(CONVERSATIONS[1])
    assert (
        trained_text(tokenizer, {"input_ids": ids, "labels": labels}) == "aba<|im_end|>§assistant<|im_end|>"
    )
    ids, labels = enc.encode(EMPTY_REPLY)  # an empty reply has nothing to train, not even its end of turn
    assert trained_text(tokenizer, {"input_ids": ids, "labels": labels}) == "dcba<|im_end|>"


@pytest.mark.parametrize(
    ("template", "trained"),
    [(CHATML_TAGGED, "aba<|im_end|>§assistant<|im_end|>"), (CHATML_TAGGED_CONTENT, "aba§assistant")],
    ids=["reply", "content"],
)
def test_tags_around_the_reply_alone_give_the_transformers_mask(tokenizer, template, trained) -> None:
    ids, labels = ChatEncoder(tokenizer, template).encode(CONVERSATIONS[1])
    out = tokenizer.apply_chat_template(
        CONVERSATIONS[1], chat_template=template, return_dict=True, return_assistant_tokens_mask=True
    )
    assert labels == [t if m else -100 for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True)]
    assert trained_text(tokenizer, {"input_ids": ids, "labels": labels}) == trained


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
