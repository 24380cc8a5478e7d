"""NF4 expert banks (quantize_base with target_parameters): the banks are packed, only routed experts are
dequantized, outputs and gradients match the dense model with the same dequantized banks, and what cannot work
(merging, casts, other quantization types, blocks that split an expert) is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora, load_pretrained, merge_lora, save_pretrained
from loralei.errors import InjectionError, LoraleiError
from loralei.inject import lora_expert_modules
from loralei.kernels import nf4 as nf4_kernels
from loralei.modules.quantized import nf4_bank
from loralei.modules.quantized.nf4_bank import NF4Bank
from tiny_models import tiny_batch, tiny_model
from tolerances import assert_fp32_close

_dequantize = nf4_kernels.dequantize  # the kernel's launcher itself, before a test patches the module's name

BANKS = ["experts.gate_up_proj", "experts.down_proj"]
BLOCKS = {"nf4_block_size": 16, "nf4_scaler_block_size": 2}  # tiny banks: 48×32 and 32×24 per expert


def _config(**extra) -> LoRAConfig:
    fields = {"r": 4, "target_parameters": BANKS, "quantize_base": True, "init_lora_weights": False, **BLOCKS}
    return LoRAConfig(**fields | extra)


def _dequantized_reference(model: torch.nn.Module, base: torch.nn.Module) -> torch.nn.Module:
    """``base`` with every bank replaced by ``model``'s dequantized NF4 bank plus the LoRA update (FP32)."""
    reference = copy.deepcopy(base)
    with torch.no_grad():
        for name, experts in lora_expert_modules(model):
            for bank in experts.adapted:
                quant = experts.quant(bank)
                dense = quant.dequantize(list(range(quant.shape[0])), torch.empty(quant.shape))
                getattr(reference.get_submodule(name), bank).copy_(dense + experts.delta_weight(bank))
    return reference


def test_banks_are_packed_and_the_dense_ones_dropped() -> None:
    model = inject_lora(tiny_model("qwen3_moe"), _config())
    for _, experts in lora_expert_modules(model):
        for bank in ("gate_up_proj", "down_proj"):
            quant = experts.quant(bank)
            assert isinstance(quant, NF4Bank) and quant.shape[0] == 6 and quant.dtype == torch.float32
            assert quant.nbytes < quant.shape.numel() * 4 / 5  # 4-bit codes plus (tiny-block) scales, vs FP32
        assert not experts.base_layer._parameters  # the replaced module holds no dense bank any more
    assert not any(p.dim() == 3 for p in model.parameters() if not p.requires_grad)


@pytest.mark.parametrize("fused", [False, True])
def test_output_and_grads_match_the_dequantized_dense_model(fused: bool) -> None:
    base = tiny_model("qwen3_moe")
    torch.manual_seed(3)
    model = inject_lora(copy.deepcopy(base), _config())
    reference = _dequantized_reference(model, base)
    torch.manual_seed(
        3
    )  # the same random factors (a deep copy would re-pack TorchAO's NF4 with default blocks)
    plain = inject_lora(copy.deepcopy(base), _config()).train()
    if fused:
        apply_fused_kernels(model)
    batch = tiny_batch()
    with torch.no_grad():
        assert_fp32_close(model(**batch).logits, reference(**batch).logits, f"fused={fused} logits")
    model.train()
    model(**batch).loss.backward()
    plain(**batch).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        if p.requires_grad:
            assert_fp32_close(p.grad, q.grad, f"fused={fused} {name}")


def test_only_routed_experts_are_dequantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewer routed rows than experts: the host reads which experts got rows and only those are dequantized."""
    model = inject_lora(tiny_model("qwen3_moe"), _config())
    apply_fused_kernels(model)
    calls: list[list[int]] = []
    original = NF4Bank.dequantize

    def spy(self, experts, out=None):
        calls.append(list(experts))
        return original(self, experts, out)

    monkeypatch.setattr(NF4Bank, "dequantize", spy)
    routed: list[set[int]] = []
    for _, experts in lora_expert_modules(model):
        experts.register_forward_pre_hook(
            lambda m, args: routed.append(set(args[1].flatten().tolist())) and None
        )
    ids = torch.tensor([[3, 5]])
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 4 and all(set(c) == routed[i // 2] for i, c in enumerate(calls))
    assert all(len(c) <= 4 for c in calls)  # 2 tokens × top-2 of 6 experts


def test_a_training_batch_dequantizes_every_expert_without_reading_the_host(monkeypatch) -> None:
    """As many routed rows as experts or more: the banks are dequantized whole (None: no list of routed experts
    read on the host, which a CUDA graph's capture forbids), in the forward and the backward. (On the CPU the
    grouped products loop over the experts; on the GPU's bf16 path nothing else reads the host either:
    tests/train/test_graphs.py replays such runs.)"""
    model = inject_lora(tiny_model("qwen3_moe"), _config())
    apply_fused_kernels(model)
    calls: list[object] = []
    original = NF4Bank.dequantize

    def spy(self, experts, out=None):
        calls.append(experts)
        return original(self, experts, out)

    monkeypatch.setattr(NF4Bank, "dequantize", spy)
    ids = torch.tensor([[3, 5, 7]])  # 3 tokens × top-2: the 6 experts' worth of rows
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls and all(experts is None for experts in calls)
    assert len(calls) >= 8  # both banks of both layers, forward and backward


def test_dequantize_leaves_other_experts_untouched() -> None:
    model = inject_lora(tiny_model("qwen3_moe"), _config())
    quant = model.model.layers[0].mlp.experts.quant("down_proj")
    out = torch.full(quant.shape, float("nan"))
    quant.dequantize([1, 4], out)
    assert out[[1, 4]].isfinite().all() and out[[0, 2, 3, 5]].isnan().all()


@pytest.mark.parametrize("interpret", [False, True], ids=["torch", "triton-interpreter"])
def test_most_experts_are_dequantized_in_one_launch_to_the_same_values(monkeypatch, interpret) -> None:
    if interpret:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = inject_lora(tiny_model("qwen3_moe"), _config())
    quant = model.model.layers[0].mlp.experts.quant("gate_up_proj")
    one_by_one = torch.stack(
        [nf4_kernels.dequantize(quant.expert(e), torch.empty(quant.shape[1:])) for e in range(6)]
    )
    launches = []
    monkeypatch.setattr(
        nf4_bank.nf4_kernels, "dequantize", lambda p, out: launches.append(p) or _dequantize(p, out)
    )
    out = torch.full(quant.shape, float("nan"))
    assert quant.dequantize([0, 2, 5], out) is out  # half of the 6 experts
    assert len(launches) == 1 and launches[0].shape == (6 * quant.shape[1], quant.shape[2])
    assert torch.equal(out, one_by_one)
    quant.dequantize([1, 3], out.fill_(float("nan")))  # fewer: one launch each, the others untouched
    assert (
        len(launches) == 3
        and torch.equal(out[[1, 3]], one_by_one[[1, 3]])
        and out[[0, 2, 4, 5]].isnan().all()
    )
    quant.dequantize(None, out.fill_(float("nan")))  # None: every expert, one launch
    assert len(launches) == 4 and torch.equal(out, one_by_one)


def test_native_checkpoint_repacks_the_same_bytes(tmp_path) -> None:
    base = tiny_model("qwen3_moe")
    model = inject_lora(copy.deepcopy(base), _config())
    save_pretrained(model, tmp_path / "a")
    loaded = load_pretrained(copy.deepcopy(base), tmp_path / "a")
    for (_, a), (_, b) in zip(lora_expert_modules(model), lora_expert_modules(loaded), strict=True):
        pa, pb = a.quant("gate_up_proj").whole.packed, b.quant("gate_up_proj").whole.packed
        assert torch.equal(pa.data, pb.data) and torch.equal(pa.scalers, pb.scalers)
    batch = tiny_batch()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


def test_merging_and_casting_are_refused() -> None:
    model = inject_lora(tiny_model("qwen3_moe"), _config())
    with pytest.raises(InjectionError, match="NF4 expert banks cannot be merged"):
        merge_lora(model)
    with pytest.raises(LoraleiError, match="cannot cast a model with quantized LoRA bases"):
        model.half()


def test_bank_checks_before_anything_changes() -> None:
    model = tiny_model("qwen3_moe")
    with pytest.raises(InjectionError, match="not a multiple of nf4_block_size"):
        inject_lora(model, _config(nf4_block_size=64, nf4_scaler_block_size=256))
    for kind in ("int4", "fp8"):
        with pytest.raises(InjectionError, match=f"quantization_type='{kind}' does not pack expert banks"):
            inject_lora(
                model, LoRAConfig(target_parameters=BANKS, quantize_base=True, quantization_type=kind)
            )
    assert not list(lora_expert_modules(model))
