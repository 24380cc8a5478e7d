"""Model level: fused and plain runs of tiny real-family models give the same loss and LoRA gradients (fp32).

Dropout: both paths draw their masks with the same function in the same order, so under the same RNG seed
they must use identical masks; a fused path that drew or reused masks differently would fail these tests.
"""

from __future__ import annotations

import pytest
import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora, remove_fused_kernels
from loralei.fusion import groups, mlp, norms
from loralei.modules import lora_linear
from loralei.ops import lowrank_sum, projection
from tiny_models import tiny_batch, tiny_model
from tolerances import FP32_REL, rel_err


class _Spy:
    """Counts calls of a module-level function while forwarding them."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> list[torch.Tensor]:
    torch.manual_seed(1234)  # same dropout masks in both runs
    loss = model(**batch).loss
    params = [p for p in model.parameters() if p.requires_grad]
    return [loss.detach(), *torch.autograd.grad(loss, params)]


def _lora_model(family: str, dropout: float, checkpointing: bool) -> torch.nn.Module:
    model = tiny_model(family)
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_fused_equals_plain(family: str, dropout: float, checkpointing: bool, monkeypatch) -> None:
    model = _lora_model(family, dropout, checkpointing)
    batch = tiny_batch()
    plain = _loss_and_grads(model, batch)
    spies = {
        name: _Spy(getattr(mod, name)) for mod, name in ((groups, "lora_group"), (lora_linear, "lora_w"))
    }
    spies["lora_mlp"] = _Spy(mlp.lora_mlp)
    monkeypatch.setattr(groups, "lora_group", spies["lora_group"])
    monkeypatch.setattr(lora_linear, "lora_w", spies["lora_w"])
    monkeypatch.setattr(mlp, "lora_mlp", spies["lora_mlp"])

    report = apply_fused_kernels(model)
    assert (
        not report.plain_projections
        and report.count("gated MLP") == 2
        and report.count("shared-input group") == 2
        and report.count("RMSNorm") == sum(map(norms.is_rms_norm, model.modules())) > 0
        and report.count("RoPE") == 1
    )
    fused = _loss_and_grads(model, batch)
    # every layer ran its fused ops (twice per layer with checkpointing: forward and recompute)
    assert {name: spy.calls for name, spy in spies.items()} == dict.fromkeys(spies, 2 * (1 + checkpointing))
    errors = [rel_err(f, p) for f, p in zip(fused, plain, strict=True)]
    assert max(errors) <= FP32_REL, errors
    if dropout:
        torch.manual_seed(99)  # another seed must change the loss, so the masks above really mattered
        assert rel_err(model(**batch).loss.detach(), plain[0]) > 1e-4
    remove_fused_kernels(model)
    assert max(rel_err(r, p) for r, p in zip(_loss_and_grads(model, batch), plain, strict=True)) == 0.0


@pytest.mark.parametrize(
    "options", [{"mlp": False}, {"shared_input_groups": None}, {"qkv": False, "o": False}]
)
def test_partial_fusion_equals_plain(options: dict) -> None:
    model = _lora_model("qwen2", dropout=0.1, checkpointing=False)
    batch = tiny_batch()
    plain = _loss_and_grads(model, batch)
    apply_fused_kernels(model, **options)
    fused = _loss_and_grads(model, batch)
    assert max(rel_err(f, p) for f, p in zip(fused, plain, strict=True)) <= FP32_REL


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_fused_triton_kernels_equal_plain(family: str, checkpointing: bool, monkeypatch) -> None:
    """The Triton kernels (interpreter, fp32) inside the fused model: the MLP's fused backward, the RMSNorm
    kernels (Gemma's (1 + w) form, Qwen3's per-head q/k norms) and the RoPE kernel included."""
    pytest.importorskip("triton")
    from loralei.kernels import gated_mlp
    from loralei.kernels import rms_norm as norm_kernels
    from loralei.kernels import rope as rope_kernels

    model = _lora_model(family, dropout=0.0, checkpointing=checkpointing)
    batch = tiny_batch()
    plain = _loss_and_grads(model, batch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backward = _Spy(gated_mlp._backward_impl)
    monkeypatch.setattr(gated_mlp, "_backward_impl", backward)
    norm_spies = {name: _Spy(getattr(norm_kernels, name)) for name in ("_forward_impl", "_backward_impl")}
    for name, spy in norm_spies.items():
        monkeypatch.setattr(norm_kernels, name, spy)
    rope = _Spy(rope_kernels._launch)
    monkeypatch.setattr(rope_kernels, "_launch", rope)
    down_terms = _Spy(lowrank_sum._LowRankSum.apply)
    monkeypatch.setattr(lowrank_sum._LowRankSum, "apply", down_terms)
    runs: list[
        tuple[int, int]
    ] = []  # (members, base GEMMs) of each input gradient: merged where side by side

    def count_runs(dys, ws):
        out = joint_runs(dys, ws)
        runs.append((len(dys), len(out)))
        return out

    joint_runs = projection.joint_runs
    monkeypatch.setattr(projection, "joint_runs", count_runs)
    report = apply_fused_kernels(model)
    fused = _loss_and_grads(model, batch)
    # q/k/v of each layer: the RoPE backward writes dq and dk side by side with room for dv, and the weights lie
    # stacked, so one GEMM (gate and up keep two: the MLP's kernel writes dG and dU apart). Qwen3's per-head q/k
    # norms come between: their backward writes dq and dk apart, and the three GEMMs stay.
    assert [n for members, n in runs if members == 3] == [3 if family == "qwen3" else 1] * 2
    assert backward.calls == (2 if gated_mlp.interpreter_runs_loops() else 0)  # one per layer
    n_norms = report.count("RMSNorm")
    # every norm forward (again in each recomputed layer: all but the final norm); every backward but the first
    # layer's input norm, which reads the frozen embeddings (nothing to differentiate there)
    forwards = n_norms + (n_norms - 1 if checkpointing else 0)
    assert (norm_spies["_forward_impl"].calls, norm_spies["_backward_impl"].calls) == (forwards, n_norms - 1)
    # q and k of each of the 2 layers: forward, backward, and the recomputed forward with checkpointing
    assert rope.calls == 2 * 2 * (2 + checkpointing)
    # the down projection's LoRA term joins each pre-norm layer's last add, but not in checkpointed layers
    # (Gemma 2's layers have four norms: not the pre-norm composition)
    assert down_terms.calls == (0 if checkpointing or family == "gemma2" else 2)
    errors = [rel_err(f, p) for f, p in zip(fused, plain, strict=True)]
    assert max(errors) <= FP32_REL, errors
