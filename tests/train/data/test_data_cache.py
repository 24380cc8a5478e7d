"""The token cache: reused across max_seq_length / packing / truncate, missed when the tokens would differ,
never trusted half written."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path

import pytest
from data_helpers import CHATML, chat, trained_text

from loralei.train.data import DataError, prepare_sft_dataset
from loralei.train.data import cache as cache_module
from loralei.train.data import tokens as tokens_module

WORDS = ["ab", "abcdef", "abc", "abcdefgh", "a", "abcd", "abcdefg", "abcdefghijklmnop"]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def data(write_jsonl) -> str:
    return write_jsonl([chat(f"reverse: {w}", w[::-1]) for w in WORDS])


def _entries(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in (cache_dir / "tokens").iterdir())


def _no_loading(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the data was loaded again")

    monkeypatch.setattr(tokens_module, "load_rows", fail)


def test_other_lengths_packing_and_truncation_reuse_the_tokens(
    tokenizer, data, cache_dir, monkeypatch
) -> None:
    cold = prepare_sft_dataset(tokenizer, path=data, max_seq_length=48, packing=False)
    assert not cold.summary.from_cache and "from the cache" not in str(cold.summary)
    assert cold.summary.dropped == {"too long": 1}
    entries = _entries(cache_dir)
    _no_loading(monkeypatch)
    warm = prepare_sft_dataset(tokenizer, path=data, max_seq_length=48, packing=False)
    assert warm.summary == cold.summary.__class__(**{**cold.summary.__dict__, "from_cache": True})
    assert str(warm.summary).endswith("; tokens from the cache")
    assert [warm[i] for i in range(len(warm))] == [cold[i] for i in range(len(cold))]
    longer = prepare_sft_dataset(tokenizer, path=data, max_seq_length=64, packing=True, seed=1)
    assert longer.summary.from_cache and longer.summary.rows_kept == len(WORDS) and longer.packed
    cut = prepare_sft_dataset(tokenizer, path=data, max_seq_length=48, packing=False, truncate=True)
    assert cut.summary.truncated == 1 and max(len(cut[i]["input_ids"]) for i in range(len(cut))) == 48
    assert _entries(cache_dir) == entries


def test_what_changes_the_tokens_misses_the_cache(tokenizer, data, cache_dir, write_jsonl) -> None:
    def prepare(tok=tokenizer, path=data, **kw):
        return prepare_sft_dataset(tok, path=path, max_seq_length=64, packing=False, **kw).summary.from_cache

    assert not prepare()
    assert prepare()
    assert not prepare(chat_template=CHATML.replace("<|im_start|>", "<|im_start|> "))
    assert not prepare(messages_field="messages")
    assert not prepare(path=data, split="train[:3]")
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["abc"])
    assert not prepare(tok=other)
    Path(data).write_text(Path(data).read_text().replace("reverse", "mirror"))
    os.utime(data, ns=(1, 1))  # a new size and time: the file changed
    assert not prepare()
    assert len(_entries(cache_dir)) == 6


def test_a_failed_build_leaves_nothing(tokenizer, data, cache_dir) -> None:
    with pytest.raises(DataError, match="all 8 rows"):
        prepare_sft_dataset(tokenizer, path=data, max_seq_length=8, packing=False)
    assert _entries(cache_dir) == []


def test_two_processes_filling_one_key_share_one_entry(tokenizer, data, cache_dir, monkeypatch) -> None:
    publish, inner = cache_module.publish, []

    def publish_after_another(tmp, parts, meta):
        if not inner:  # another process finishes the same key first
            monkeypatch.setattr(cache_module, "publish", publish)
            inner.append(prepare_sft_dataset(tokenizer, path=data, max_seq_length=64, packing=False))
        return publish(tmp, parts, meta)

    monkeypatch.setattr(cache_module, "publish", publish_after_another)
    outer = prepare_sft_dataset(tokenizer, path=data, max_seq_length=64, packing=False)
    assert len(_entries(cache_dir)) == 1  # no temp dirs left either
    assert [outer[i] for i in range(len(outer))] == [inner[0][i] for i in range(len(inner[0]))]


def test_a_broken_entry_is_rebuilt(tokenizer, data, cache_dir) -> None:
    cold = prepare_sft_dataset(tokenizer, path=data, max_seq_length=64, packing=False)
    (entry,) = (cache_dir / "tokens").iterdir()
    (entry / "ids.npy").unlink()
    again = prepare_sft_dataset(tokenizer, path=data, max_seq_length=64, packing=False)
    assert not again.summary.from_cache and (entry / "ids.npy").exists()
    assert [again[i] for i in range(len(again))] == [cold[i] for i in range(len(cold))]
    assert _entries(cache_dir) == [entry.name]


def test_an_unwritable_cache_dir_is_one_clear_error(tokenizer, data, tmp_path, monkeypatch) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LORALEI_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(
        DataError, match=r"^LORALEI_CACHE_DIR: cannot write the token cache under .*file/cache"
    ):
        prepare_sft_dataset(tokenizer, path=data, max_seq_length=64, packing=False)


def test_the_cache_lives_in_the_user_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("LORALEI_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_module.cache_root() == tmp_path / "xdg" / "loralei"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_module.cache_root() == tmp_path / "home" / ".cache" / "loralei"


def test_a_dataset_pickles_as_the_path_of_its_tokens(tokenizer, data, cache_dir) -> None:
    ds = prepare_sft_dataset(tokenizer, path=data, max_seq_length=64, packing=True)
    blob = pickle.dumps(ds)
    assert len(blob) < 4096  # the memory-mapped arrays are not copied into the pickle
    again = pickle.loads(blob)
    assert [again[i] for i in range(len(again))] == [ds[i] for i in range(len(ds))]
    assert sorted(a for i in range(len(ds)) for a in trained_text(tokenizer, ds[i]).split("§")) == sorted(
        w[::-1] + "<|im_end|>" for w in WORDS
    )


def test_a_tokenizer_without_a_fast_backend_is_tokenized_here_and_not_cached(
    tokenizer, write_jsonl, cache_dir, monkeypatch
) -> None:
    path = write_jsonl([{"text": "hello there"}, {"text": ""}])
    fast = prepare_sft_dataset(tokenizer, path=path, max_seq_length=64, packing=False)
    monkeypatch.setattr(tokens_module.TokenizerSpec, "of", classmethod(lambda cls, tok: None))
    for _ in range(2):
        slow = prepare_sft_dataset(tokenizer, path=path, max_seq_length=64, packing=False)
        assert not slow.summary.from_cache and slow.summary.dropped == {"empty": 1}
        assert slow[0] == fast[0]
    assert len(_entries(cache_dir)) == 1  # the fast tokenizer's entry only
