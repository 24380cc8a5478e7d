"""The committed quickstart assets load, fit the pipeline, and are what make_assets.py builds."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from data_helpers import QUICKSTART, REPO
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from loralei.train.data import make_collator, prepare_sft_dataset

PARQUET = REPO / "examples" / "data" / "upper_pretokenized.parquet"


@pytest.fixture(scope="module")
def make_assets():
    spec = importlib.util.spec_from_file_location("make_assets", QUICKSTART / "make_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_assets_are_small() -> None:
    files = [*QUICKSTART.rglob("*"), PARQUET]
    assert sum(f.stat().st_size for f in files if f.is_file()) < 2 * 2**20


def test_tokenizer_and_model_load_and_agree(tokenizer) -> None:
    assert tokenizer.is_fast
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "upper: abcde"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nupper: abcde<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer("upper: abcde")["input_ids"]) == "upper: abcde"
    model = AutoModelForCausalLM.from_pretrained(QUICKSTART / "model")
    assert model.config.model_type == "qwen3"
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 1_000_000
    assert model.config.vocab_size >= len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("path", [QUICKSTART / "data.jsonl", PARQUET], ids=["jsonl", "parquet"])
def test_pipeline_runs_on_the_assets(tokenizer, path) -> None:
    ds = prepare_sft_dataset(tokenizer, path=str(path), split="train[:64]", max_seq_length=128, packing=True)
    assert ds.summary.rows_kept == 64 and not ds.summary.dropped
    batch = make_collator(
        tokenizer.pad_token_id, max_seq_length=128, pad_to_max_length=True, packed=True, attention_mask=False
    )([ds[0], ds[1]])
    model = AutoModelForCausalLM.from_pretrained(QUICKSTART / "model")
    with torch.no_grad():
        loss = model(**batch, use_cache=False).loss
    assert torch.isfinite(loss)


def test_parquet_matches_the_chat_pipeline(tokenizer) -> None:
    chat_rows = prepare_sft_dataset(
        tokenizer, path=str(QUICKSTART / "data.jsonl"), split="train[:20]", max_seq_length=128, packing=False
    )
    parquet_rows = prepare_sft_dataset(
        tokenizer, path=str(PARQUET), split="train[:20]", max_seq_length=128, packing=False
    )
    assert [chat_rows[i] for i in range(20)] == [parquet_rows[i] for i in range(20)]


def test_make_assets_reproduces_the_committed_files(make_assets, tokenizer) -> None:
    built = make_assets.build_tokenizer()
    committed = json.loads((QUICKSTART / "model" / "tokenizer.json").read_text())
    assert json.loads(built.backend_tokenizer.to_str()) == committed
    weights = load_file(QUICKSTART / "model" / "model.safetensors")
    model = make_assets.build_model(built, seed=0)
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name
    rows = make_assets.build_rows(1200, seed=0)
    assert [json.loads(line) for line in (QUICKSTART / "data.jsonl").read_text().splitlines()] == rows
    held_out = [make_assets.task_row(word) for word in make_assets.HELD_OUT_WORDS]
    assert [json.loads(line) for line in (QUICKSTART / "heldout.jsonl").read_text().splitlines()] == held_out
    kto = make_assets.build_kto_rows(make_assets.KTO_ROWS, seed=0)
    assert [json.loads(line) for line in (QUICKSTART / "kto.jsonl").read_text().splitlines()] == kto


def _rows(name: str) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in (QUICKSTART / name).read_text().splitlines()]


@pytest.mark.parametrize("name", ["data.jsonl", "heldout.jsonl"])
def test_every_row_asks_for_a_five_letter_word_in_capitals(name: str) -> None:
    rows = _rows(name)
    assert len(rows) == {"data.jsonl": 1200, "heldout.jsonl": 30}[name]
    for user, assistant in rows:
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        prefix, word = user["content"].split(": ")
        assert prefix == "upper" and len(word) == 5 and word.isalpha() and word.islower()
        assert assistant["content"] == word.upper()


def test_held_out_words_are_unseen_in_training() -> None:
    """The quickstart's score is on words no training row holds, and none of them repeats."""
    training = {user["content"] for user, _ in _rows("data.jsonl")}
    held_out = [user["content"] for user, _ in _rows("heldout.jsonl")]
    assert len(set(held_out)) == len(held_out) and not set(held_out) & training
