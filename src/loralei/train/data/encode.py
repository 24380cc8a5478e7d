"""Turning raw rows into tokens: the ids, which of them are trained, or a reason to drop the row.

Rows are encoded whole, with no length limit: the token cache keeps them so, and ``training.max_seq_length``,
truncation and the check that a trained token is left are applied afterwards, on arrays (``select.py``). Texts are
gathered from a batch of rows and tokenized together; the first token of a row is never trained (masking it also
stops a packed sample from being trained to predict its first token from the previous sample's last one). A
preference row encodes to two sequences, chosen then rejected, each stored as a row of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .formats import RowFormat
from .messages import EMPTY, MALFORMED, OUTSIDE_VOCABULARY, normalize_messages
from .preference_rows import PreferenceColumns, split_pair
from .template import IGNORE_INDEX, ChatRenderer, DropRow, RenderedChat, chat_mask

# Part of the token cache's key: bump it whenever the encoding of a row changes, so that stale tokens are not reused.
ENCODING_VERSION = 4
# Encoded sequences a row of each format gives, one after the other (1 when not named here).
SEQUENCES = {"preference": 2}


def _text(value: Any) -> str:
    if value is None or value == "":
        raise DropRow(EMPTY)
    if not isinstance(value, str):
        raise DropRow(MALFORMED)
    return value


@dataclass
class EncodedRow:
    """One row's tokens: ``ids``, ``trained`` (a bool per token), and ``labels`` only where they may differ from
    the ids (pretokenized rows with a labels column)."""

    ids: np.ndarray
    trained: np.ndarray
    labels: np.ndarray | None = None


@dataclass
class _Plan:
    texts: list[tuple[str, bool]]  # (text, add_special_tokens), tokenized with the rest of the batch
    finish: Callable[[list[Any]], EncodedRow]  # the row from the encodings of its texts


def _ids(encoding: Any) -> np.ndarray:
    return np.asarray(encoding.ids, dtype=np.int64)


@dataclass
class BatchEncoder:
    """Encodes batches of rows of one format.

    Attributes:
        fmt: the row format and its columns.
        tokenizer: a ``tokenizers.Tokenizer`` (or ``backend.SlowTokenizer``).
        chat: renders conversations, for formats that use the chat template (None otherwise).
        eos_token_id: appended to plain-text rows and completions (None: nothing is appended).
        vocab_size: pretokenized ids must be below it.
        keep_labels: keep pretokenized rows' own labels (the data has a labels column).
        batched: tokenize a batch in one ``encode_batch`` call (in workers; the main process encodes text by text
            so that the tokenizer's thread pool is never started before a fork).
    """

    fmt: RowFormat
    tokenizer: Any
    chat: ChatRenderer | None
    eos_token_id: int | None
    vocab_size: int
    keep_labels: bool = False
    batched: bool = False

    def encode(self, rows: Sequence[dict]) -> list[EncodedRow | str]:
        """Encodes rows; each result is a sequence's tokens or the reason it is dropped (one of ``REASONS``).

        A row gives ``SEQUENCES[kind]`` results in a row (a preference pair: chosen, then rejected); a row that
        cannot be split into its sequences gives its reason for each.
        """
        plans: list[_Plan | str] = []
        for row in rows:
            try:
                planned = _PLANNERS[self.fmt.kind](self, row)
                plans += planned if isinstance(planned, list) else [planned]
            except DropRow as drop:
                plans += [drop.args[0]] * SEQUENCES.get(self.fmt.kind, 1)
        encodings = iter(self._tokenize([t for p in plans if isinstance(p, _Plan) for t in p.texts]))
        out: list[EncodedRow | str] = []
        for plan in plans:
            if isinstance(plan, str):
                out.append(plan)
                continue
            row = plan.finish([next(encodings) for _ in plan.texts])
            out.append(_first_token_untrained(row) if len(row.ids) else EMPTY)
        return out

    def _tokenize(self, texts: list[tuple[str, bool]]) -> list[Any]:
        if not self.batched:
            return [self.tokenizer.encode(text, add_special_tokens=special) for text, special in texts]
        out: list[Any] = [None] * len(texts)
        for special in (False, True):
            at = [i for i, (_, s) in enumerate(texts) if s == special]
            if at:
                done = self.tokenizer.encode_batch([texts[i][0] for i in at], add_special_tokens=special)
                for i, encoding in zip(at, done, strict=True):
                    out[i] = encoding
        return out

    def with_eos(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` ending in the eos token (appended unless it is already last)."""
        eos = self.eos_token_id
        return np.append(ids, eos) if eos is not None and (not ids.size or ids[-1] != eos) else ids

    def chat_plan(self, messages: list[dict], answers: int | None = None) -> _Plan:
        """Renders a normalised conversation with the chat template (for every chat-rendering format).

        Args:
            messages: the conversation.
            answers: train only the last ``answers`` assistant turns (None: every one).
        """
        chat = self.chat.render(messages)
        if answers is not None:
            chat = dataclasses.replace(chat, spans=chat.spans[len(chat.spans) - answers :] if answers else [])
        return _Plan([(chat.text, False)], lambda encodings: _chat_row(encodings[0], chat))

    def text_plan(self, prompt: str, completion: str) -> _Plan:
        """A prompt (with the tokenizer's special tokens, not trained) followed by a completion + eos (trained)."""

        def finish(encodings: list[Any]) -> EncodedRow:
            prompt_ids, completion_ids = _ids(encodings[0]), self.with_eos(_ids(encodings[1]))
            trained = np.concatenate([np.zeros(len(prompt_ids), bool), np.ones(len(completion_ids), bool)])
            return EncodedRow(np.concatenate([prompt_ids, completion_ids]), trained)

        return _Plan([(prompt, True), (completion, False)], finish)


def _chat_row(encoding: Any, chat: RenderedChat) -> EncodedRow:
    return EncodedRow(_ids(encoding), chat_mask(encoding, chat))


def _first_token_untrained(row: EncodedRow) -> EncodedRow:
    row.trained[0] = False
    if row.labels is not None:
        row.labels[0] = IGNORE_INDEX
    return row


def _plan_messages(enc: BatchEncoder, row: dict) -> _Plan:
    return enc.chat_plan(normalize_messages(row[enc.fmt.columns["messages"]]))


def _plan_instruction(enc: BatchEncoder, row: dict) -> _Plan:
    cols = enc.fmt.columns
    prompt = _text(row[cols["instruction"]])
    extra = row.get(cols["input"]) if "input" in cols else None
    if extra:
        prompt = f"{prompt}\n\n{_text(extra)}"
    turns = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": _text(row[cols["response"]])},
    ]
    return enc.chat_plan(turns)


def _plan_prompt_completion(enc: BatchEncoder, row: dict) -> _Plan:
    """Only the completion trained: text, or of a conversation the completion's assistant turns (a multi-turn
    prompt's own answers are context, as TRL's ``completion_only_loss`` has it)."""
    prompt, completion = row[enc.fmt.columns["prompt"]], row[enc.fmt.columns["completion"]]
    if isinstance(prompt, list) or isinstance(completion, list):  # conversational prompt/completion
        messages = normalize_messages((prompt or []) + (completion or []))
        answers = messages[len(prompt or []) :]
        return enc.chat_plan(messages, sum(1 for m in answers if m["role"] == "assistant" and m["content"]))
    return enc.text_plan(_text(prompt), _text(completion))


def _plan_pair(enc: BatchEncoder, row: dict) -> list[_Plan]:
    """A preference row's chosen and rejected sequences: the prompt then each completion, only the completion
    trained (of a conversation, its assistant turns; a multi-turn prompt's own answers are context)."""
    cols = enc.fmt.columns
    prompt, *completions = split_pair(
        row, PreferenceColumns(cols.get("prompt"), cols["chosen"], cols["rejected"])
    )
    if isinstance(prompt, str):
        return [enc.text_plan(prompt, completion) for completion in completions]
    answers = [sum(1 for m in c if m["role"] == "assistant" and m["content"]) for c in completions]
    return [enc.chat_plan(prompt + c, n) for c, n in zip(completions, answers, strict=True)]


def _plan_text(enc: BatchEncoder, row: dict) -> _Plan:
    def finish(encodings: list[Any]) -> EncodedRow:
        ids = enc.with_eos(_ids(encodings[0]))
        return EncodedRow(ids, np.ones(len(ids), bool))

    return _Plan([(_text(row[enc.fmt.columns["text"]]), True)], finish)


def _int_array(value: Any) -> np.ndarray:
    if not isinstance(value, list):
        raise DropRow(MALFORMED)
    array = np.asarray(value) if value else np.zeros(0, np.int64)
    if array.dtype.kind not in "iu" or array.ndim != 1:  # None entries, floats, strings, nested lists
        raise DropRow(MALFORMED)
    return array.astype(np.int64, copy=False)


def _plan_pretokenized(enc: BatchEncoder, row: dict) -> _Plan:
    ids = _int_array(row["input_ids"])
    labels = _int_array(row["labels"]) if row.get("labels") is not None else ids
    mask = _int_array(row["attention_mask"]) if row.get("attention_mask") is not None else None
    if len(labels) != len(ids) or (mask is not None and len(mask) != len(ids)):
        raise DropRow(MALFORMED)
    if ids.size and (ids.min() < 0 or ids.max() >= enc.vocab_size):
        raise DropRow(OUTSIDE_VOCABULARY)
    if mask is not None:  # attention_mask 0 marks padding: not part of the sample
        ids, labels = ids[mask != 0], labels[mask != 0]
    row_out = EncodedRow(ids, labels != IGNORE_INDEX, labels.copy() if enc.keep_labels else None)
    return _Plan([], lambda _encodings: row_out)


_PLANNERS: dict[str, Callable[[BatchEncoder, dict], _Plan | list[_Plan]]] = {
    "messages": _plan_messages,
    "instruction": _plan_instruction,
    "prompt_completion": _plan_prompt_completion,
    "text": _plan_text,
    "pretokenized": _plan_pretokenized,
    "preference": _plan_pair,
}
