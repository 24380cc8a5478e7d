"""Packed batches give exactly the per-sample logits and loss: no attention across sample boundaries."""

from __future__ import annotations

import json

import pytest
import torch
from data_helpers import chat
from tests.tiny_models import tiny_model

from loralei.train.data import make_collator, prepare_sft_dataset
from loralei.train.data.collate import FLEX_MIN_TOKENS

MAX_LEN = 96
WORDS = ["ab", "abcdefg", "abc", "abcdefgh", "a", "abcd", "abcdef", "xyz"]


@pytest.fixture(scope="module")
def packed_data(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("packed") / "d.jsonl"
    path.write_text("".join(json.dumps(chat(f"rev {w}", w[::-1])) + "\n" for w in WORDS))
    ds = prepare_sft_dataset(tokenizer, path=str(path), max_seq_length=MAX_LEN, packing=True)
    assert ds.summary.packed_sequences < len(WORDS)  # the test needs several samples per row
    return ds


def _model(attn: str, **overrides):
    model = tiny_model("llama", **overrides)
    model.set_attn_implementation(attn)
    return model


def _reference(model, ds, device: str = "cpu") -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-sample logits, and the loss over all samples' targets (sum of token losses / number of targets)."""
    logits, total, count = [], torch.zeros((), dtype=torch.float64, device=device), 0
    with torch.no_grad():
        for b in ds.bins:
            for i in b:
                row = ds.rows[i]
                ids = torch.tensor([row["input_ids"]], device=device)
                labels = torch.tensor([row["labels"]], device=device)
                out = model(input_ids=ids, labels=labels, use_cache=False)
                n = int((labels[:, 1:] != -100).sum())
                logits.append(out.logits[0])
                total += out.loss.double() * n
                count += n
    return logits, total / count


def _packed(model, ds, batch: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of each sample cut out of the packed forward (rows of equal width, flattened or not), and its loss."""
    with torch.no_grad():
        out = model(**batch, use_cache=False)
    flat = out.logits.reshape(-1, out.logits.shape[-1])
    width = flat.shape[0] // len(ds.bins)
    pieces = []
    for row, b in enumerate(ds.bins):
        offset = row * width
        for i in b:
            n = len(ds.rows[i]["input_ids"])
            pieces.append(flat[offset : offset + n])
            offset += n
    return pieces, out.loss.double()


def _compare(ref, got) -> None:
    ref_logits, ref_loss = ref
    logits, loss = got
    assert len(logits) == len(ref_logits)
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)


def _batch(ds, **kw) -> dict:
    args = {"max_seq_length": MAX_LEN, "pad_to_max_length": True, "packed": True, "attention_mask": False}
    return make_collator(0, **{**args, **kw})([ds[i] for i in range(len(ds))])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mask", [True, False], ids=["4d-mask", "position-ids-only"])
def test_packed_forward_equals_per_sample_forward(packed_data, attn, mask) -> None:
    model = _model(attn)
    batch = _batch(packed_data, attention_mask=mask, attn_implementation=attn)
    assert ("attention_mask" in batch) == mask
    _compare(_reference(model, packed_data), _packed(model, packed_data, batch))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_4d_masks_work_in_bf16(packed_data, attn) -> None:
    # The bool (sdpa) and float32 additive (eager) masks must also fit bf16 scores.
    model = tiny_model("llama", dtype=torch.bfloat16)
    model.set_attn_implementation(attn)
    batch = _batch(packed_data, attention_mask=True, attn_implementation=attn)
    ref_logits, ref_loss = _reference(model, packed_data)
    logits, loss = _packed(model, packed_data, batch)
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=0)


def test_flat_varlen_layout_equals_per_sample_forward(packed_data) -> None:
    # The one-row layout made for flash attention, checked on CPU through sdpa's position_ids detection.
    model = _model("sdpa")
    batch = _batch(packed_data, attn_implementation="flash_attention_2")
    assert batch["input_ids"].shape == (1, MAX_LEN * len(packed_data))
    _compare(_reference(model, packed_data), _packed(model, packed_data, batch))


@pytest.mark.parametrize("mask", [True, False], ids=["mask-asked", "no-mask"])
def test_flex_attention_keeps_packed_samples_apart_without_a_dense_mask(packed_data, mask) -> None:
    """flex_attention: the collator adds no mask (whatever omit_attention_mask_when_packed says), the model builds
    its block-sparse document mask from position_ids, and each sample's logits and the loss of the packed
    forward equal those of the samples run alone (sdpa)."""
    batch = _batch(packed_data, attention_mask=mask, attn_implementation="flex_attention")
    # rows padded to flex's minimum width (MAX_LEN is shorter): the padding is one more sample of its own
    assert "attention_mask" not in batch and batch["input_ids"].shape == (len(packed_data), FLEX_MIN_TOKENS)
    _compare(_reference(_model("sdpa"), packed_data), _packed(_model("flex_attention"), packed_data, batch))


@pytest.mark.gpu
def test_flex_attention_gradients_of_packed_rows_equal_the_samples_alone(packed_data) -> None:
    """The backward through flex attention's document mask (CUDA: PyTorch has no CPU backward for it): LoRA
    gradients of the packed loss equal those of the same loss summed from each sample run alone. The rows
    (MAX_LEN tokens) are shorter than flex's backward takes: the collator's padding makes them fit."""
    from loralei import LoRAConfig, inject_lora

    def lora_model(attn: str) -> torch.nn.Module:
        model = _model(attn, head_dim=16)  # flex's CUDA kernels take heads of 16 dims or more
        inject_lora(model, LoRAConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        return model

    def grads(model) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    ref = lora_model("sdpa").cuda()
    total, count = 0, 0
    for b in packed_data.bins:
        for i in b:
            row = packed_data.rows[i]
            ids, labels = torch.tensor([row["input_ids"]]).cuda(), torch.tensor([row["labels"]]).cuda()
            n = int((labels[:, 1:] != -100).sum())
            total = total + ref(input_ids=ids, labels=labels, use_cache=False).loss * n
            count += n
    (total / count).backward()
    flex = lora_model("flex_attention").cuda()
    batch = {k: v.cuda() for k, v in _batch(packed_data, attn_implementation="flex_attention").items()}
    flex(**batch, use_cache=False).loss.backward()
    want, got = grads(ref), grads(flex)
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_transformers_needs_use_cache_false_to_detect_packing(packed_data) -> None:
    # Why the collator documents use_cache=False: with the default cache Transformers skips packed-sequence
    # detection and the samples attend to each other. If this starts failing, Transformers changed and the
    # note in collate.py can go.
    model = _model("sdpa")
    batch = _batch(packed_data, attn_implementation="sdpa")
    with torch.no_grad():
        cached = model(**batch).logits
        uncached = model(**batch, use_cache=False).logits
    assert not torch.allclose(cached, uncached, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["flash_attention_2", "sdpa"])
def test_packed_forward_on_gpu(packed_data, attn) -> None:
    if attn.startswith("flash"):
        pytest.importorskip("flash_attn")
    model = tiny_model("llama", dtype=torch.bfloat16).cuda()
    model.set_attn_implementation(attn)
    batch = {k: v.cuda() for k, v in _batch(packed_data, attn_implementation=attn).items()}
    ref_logits, ref_loss = _reference(model, packed_data, device="cuda")
    logits, loss = _packed(model, packed_data, batch)
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=0)
