"""Helpers shared by the data-pipeline tests."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "examples" / "quickstart"

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


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
