"""A DoRA forward's norms ``‖W + s B A‖_row``, taken again by its checkpoint's recomputation
(``modules.dora.step_norms``): computed once a step per projection under checkpointing, with the same loss and
gradients bit for bit as computing them again; never taken by a forward, nor after the factors changed; dropped
by pickling and by moving the module."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.modules import dora
from loralei.ops import recompute
from loralei.ops.dora import row_norms, squared_row_norms
from loralei.train.checkpointing import enable_checkpointing
from tiny_models import perturb_magnitudes, tiny_batch, tiny_model

PROJECTIONS = 14  # 2 layers x q, k, v, o, gate, up, down


def _dora_llama() -> torch.nn.Module:
    config = LoRAConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False)
    return perturb_magnitudes(inject_lora(tiny_model(), config))


class _NeverRecomputing:
    """Stands in for ``ops.recompute`` in ``modules.dora``: every call computes the norms."""

    @staticmethod
    def in_recomputation() -> bool:
        return False


def _step(checkpointing: str | None, monkeypatch, reuse: bool) -> tuple[int, list[torch.Tensor]]:
    """One forward and backward of the fused tiny DoRA Llama: how many times the norms were computed, and the loss
    and every trainable gradient."""
    model = _dora_llama()
    apply_fused_kernels(model)
    if checkpointing in ("runner", "offload"):
        enable_checkpointing(model, compiled=False, offload=checkpointing == "offload")
    elif checkpointing == "torch":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    computed = []
    with monkeypatch.context() as patch:
        patch.setattr(dora, "row_norms", lambda *a: computed.append(1) or row_norms(*a))
        if not reuse:
            patch.setattr(dora, "recompute", _NeverRecomputing)
        model.train()
        out = model(**tiny_batch())
        out.loss.backward()
    return len(computed), [out.loss.detach(), *(p.grad for p in model.parameters() if p.requires_grad)]


@pytest.mark.parametrize("checkpointing", [None, "runner", "offload", "torch"])
def test_recomputation_takes_the_forwards_norms_with_the_same_bits(checkpointing, monkeypatch) -> None:
    """The runner's checkpointing marks its recomputations; torch's own (through Transformers) does not, so its
    recomputation computes the norms again, as before."""
    count, grads = _step(checkpointing, monkeypatch, reuse=True)
    again_count, again = _step(checkpointing, monkeypatch, reuse=False)
    assert count == (2 * PROJECTIONS if checkpointing == "torch" else PROJECTIONS)
    assert again_count == (PROJECTIONS if checkpointing is None else 2 * PROJECTIONS)
    assert len(grads) == len(again) > 1
    for got, want in zip(grads, again, strict=True):
        assert torch.equal(got, want)


def _projection() -> torch.nn.Module:
    return _dora_llama().model.layers[0].self_attn.q_proj


def test_forwards_compute_and_changed_factors_are_computed_again() -> None:
    module = _projection()
    w = module.lora_weights()
    first = dora.step_norms(module, w)
    assert dora.step_norms(module, w) is not first  # a forward computes, whatever is kept
    kept = dora.step_norms(module, w)
    with recompute.recomputation(early_stop=True):
        assert dora.step_norms(module, w) is kept
        with torch.no_grad():
            module.lora_B.weight.mul_(2)  # an optimizer step, as far as the norms can tell
        fresh = dora.step_norms(module, w)
    assert fresh is not kept
    assert torch.equal(fresh, row_norms(w, squared_row_norms(w)))
    assert not torch.equal(fresh, kept)


def test_pickling_and_moving_drop_the_kept_norms() -> None:
    module = _projection()
    dora.step_norms(module, module.lora_weights())
    assert getattr(module, dora.STEP_CACHE) is not None
    for twin in (pickle.loads(pickle.dumps(module)), copy.deepcopy(module)):
        assert getattr(twin, dora.STEP_CACHE) is None
    module.to(torch.float32)
    assert getattr(module, dora.STEP_CACHE) is None
