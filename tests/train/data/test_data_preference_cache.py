"""Preference data through the SFT token pipeline: the same pairs from one or two tokenization workers, a warm run
that reads the token cache without tokenizing, misses when what decides the tokens changes, and never an SFT
entry read for pairs (or the other way round)."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from data_helpers import CHATML

from loralei.train.data import DataError, prepare_sft_dataset
from loralei.train.data import encode as encode_module
from loralei.train.data import tokens as tokens_module
from loralei.train.data import workers as workers_module
from loralei.train.data.preference import prepare_preference_dataset


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def _pair_rows(count: int) -> list[dict]:
    """Conversational pairs of growing length, and some identical or malformed ones."""
    rows = []
    for k in range(count):
        word = "abcdefghij"[: 1 + k % 10] * (1 + k % 4)
        prompt = [{"role": "user", "content": f"upper: {word}"}]
        rows.append({"prompt": prompt, "chosen": _answer(word.upper()), "rejected": _answer(word)})
        if k % 19 == 0:
            rows.append({"prompt": prompt, "chosen": _answer(word), "rejected": _answer(word)})
        if k % 23 == 0:
            robot = [{"role": "robot", "content": "x"}]
            rows.append({"prompt": prompt, "chosen": robot, "rejected": _answer(word)})
    return rows


def _prepare(tokenizer, path: str, **kwargs):
    settings = {"max_seq_length": 96, "packing": True, "fields": {}, **kwargs}
    return prepare_preference_dataset(tokenizer, path=path, **settings)


def _pairs(ds) -> list[tuple[np.ndarray, ...]]:
    return [(*ds.pairs[i].chosen, *ds.pairs[i].rejected) for i in range(len(ds.pairs))]


def _same_pairs(a, b) -> bool:
    return len(a.pairs) == len(b.pairs) and all(
        all(np.array_equal(x, y) for x, y in zip(p, q, strict=True))
        for p, q in zip(_pairs(a), _pairs(b), strict=True)
    )


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "tokens").iterdir() if not p.name.startswith("."))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_two_workers_give_the_pairs_and_bins_of_one_process(
    tokenizer, write_jsonl, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(tokens_module, "SAMPLE_ROWS", 50)
    monkeypatch.setattr(tokens_module, "MIN_PARALLEL_SECONDS", 0.0)
    spawned = []
    original = workers_module.run_workers
    monkeypatch.setattr(tokens_module, "run_workers", lambda *a: spawned.append(a[1]) or original(*a))
    path = write_jsonl(_pair_rows(240))
    done = {}
    for workers in (1, 2):
        monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path / f"cache{workers}"))
        done[workers] = _prepare(tokenizer, path, num_proc=workers, truncate=True)
    assert spawned == [2]
    one, two = done[1], done[2]
    assert _same_pairs(one, two) and one.bins == two.bins and str(one.summary) == str(two.summary)
    assert one.summary.dropped == {"chosen and rejected are identical": 13, "malformed": 11}
    assert one.summary.truncated > 0 and one.summary.pairs_kept == 240
    (entry_one,), (entry_two,) = _entries(tmp_path / "cache1"), _entries(tmp_path / "cache2")
    for array in sorted(entry_one.glob("*.npy")):
        assert array.read_bytes() == (entry_two / array.name).read_bytes(), array.name


def test_a_warm_run_reads_the_cache_and_tokenizes_nothing(
    tokenizer, write_jsonl, cache_dir, monkeypatch
) -> None:
    path = write_jsonl(_pair_rows(30))
    cold = _prepare(tokenizer, path)
    assert not cold.summary.from_cache and cold.summary.dropped["too long"] > 0

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(encode_module.BatchEncoder, "encode", fail)
    monkeypatch.setattr(tokens_module, "load_rows", fail)
    warm = _prepare(tokenizer, path)
    assert warm.summary == cold.summary.__class__(**{**cold.summary.__dict__, "from_cache": True})
    assert str(warm.summary) == str(cold.summary) + "; tokens from the cache"
    assert _same_pairs(warm, cold) and warm.bins == cold.bins
    blob = pickle.dumps(warm)  # DataLoader workers map the cached arrays again instead of copying them
    assert len(blob) < 8192 and _same_pairs(pickle.loads(blob), cold)
    # the limits are applied to the cached rows: other settings read the same entry
    cut = _prepare(tokenizer, path, truncate=True, packing=False)
    assert (
        cut.summary.from_cache
        and cut.summary.pairs_kept == cold.summary.pairs_kept + cold.summary.dropped["too long"]
    )
    assert len(_entries(cache_dir)) == 1


def test_what_changes_the_tokens_misses_the_cache(tokenizer, write_jsonl, cache_dir) -> None:
    rows = [{**row, "better": row["chosen"]} for row in _pair_rows(12)]
    path = write_jsonl(rows)

    def from_cache(tok=tokenizer, **kwargs) -> bool:
        return _prepare(tok, path, **kwargs).summary.from_cache

    assert not from_cache()
    assert from_cache()
    assert not from_cache(chat_template=CHATML.replace("<|im_start|>", "<|im_start|> "))
    assert not from_cache(fields={"chosen_field": "better"})
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["abc"])
    assert not from_cache(tok=other)
    Path(path).write_text(Path(path).read_text().replace("upper", "UPPER"))
    os.utime(path, ns=(1, 1))  # a new size and time: the file changed
    assert not from_cache()
    assert len(_entries(cache_dir)) == 5


def test_sft_and_preference_entries_of_one_file_are_never_shared(tokenizer, write_jsonl, cache_dir) -> None:
    rows = [
        {
            "prompt": f"upper: {w} =",
            "completion": f" {w.upper()}",
            "chosen": f" {w.upper()}",
            "rejected": f" {w}",
        }
        for w in ("ab", "cde", "fghi")
    ]
    path = write_jsonl(rows)
    sft = prepare_sft_dataset(tokenizer, path=path, max_seq_length=48, packing=False)
    pairs = _prepare(tokenizer, path)
    assert not sft.summary.from_cache and not pairs.summary.from_cache
    assert prepare_sft_dataset(tokenizer, path=path, max_seq_length=48, packing=False).summary.from_cache
    assert _prepare(tokenizer, path).summary.from_cache
    assert len(_entries(cache_dir)) == 2
    source = tokens_module.DataSource(path, "train", ("data.path", "data.split"), {}, None)
    origin, spec = {"file": path}, tokens_module.TokenizerSpec.of(tokenizer)
    keys = {
        pairs_flag: tokens_module._key_parts(
            dataclasses.replace(source, pairs=pairs_flag), origin, spec, tokenizer
        )
        for pairs_flag in (False, True)
    }
    assert keys[False] != keys[True]  # the same fields and file still name two entries


def test_a_sample_whose_every_pair_is_dropped_stops_before_the_rest(
    tokenizer, write_jsonl, cache_dir, monkeypatch
) -> None:
    monkeypatch.setattr(tokens_module, "SAMPLE_ROWS", 20)
    encoded = []
    original = encode_module.BatchEncoder.encode
    monkeypatch.setattr(
        encode_module.BatchEncoder,
        "encode",
        lambda self, rows: encoded.append(len(rows)) or original(self, rows),
    )
    path = write_jsonl([{"prompt": f"upper: {k} =", "chosen": " YES", "rejected": " no"} for k in range(200)])
    with pytest.raises(
        DataError,
        match=r"^data\.path: no sampled pair of .*\(evenly spread over its 200 rows\) would be left \(20 too long\); raise training\.max_seq_length",
    ):
        _prepare(tokenizer, path, max_seq_length=8)
    assert sum(encoded) == 20
    assert not (cache_dir / "tokens").exists() or _entries(cache_dir) == []
