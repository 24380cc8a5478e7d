"""training.torch_compile: per-layer compilation and selective checkpointing (matmul outputs kept)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.train import checkpointing
from loralei.train.checkpointing import enable_checkpointing
from loralei.train.compile import checkpoint_kwargs, compile_layers, decoder_layers
from tiny_models import tiny_batch, tiny_model
from tolerances import assert_fp32_close


class _CountMatmuls(TorchDispatchMode):
    """Counts the plain and accumulating GEMMs that run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _model(**lora) -> torch.nn.Module:
    model = inject_lora(tiny_model("llama"), LoRAConfig(r=4, init_lora_weights=False, **lora)).train()
    apply_fused_kernels(model)
    return model


def _step(model: torch.nn.Module, count: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    loss = model(**tiny_batch()).loss
    counter = _CountMatmuls()
    if count:
        with counter:
            loss.backward()
    else:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter.count


def _assert_same(a, b) -> None:
    assert_fp32_close(a[0], b[0], "loss")
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert_fp32_close(a[1][name], b[1][name], name)


def test_decoder_layers_are_found_and_compiled_one_by_one() -> None:
    model = tiny_model("qwen3")
    layers = decoder_layers(model)
    assert layers is model.model.layers
    assert compile_layers(model) == "2 decoder layers compiled one by one with torch.compile"
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None


def test_selective_checkpointing_recomputes_fewer_matmuls_with_the_same_gradients() -> None:
    plain = _step(_model(), count=True)
    full, selective = _model(), _model()
    full.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(selective=False))
    selective.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(selective=True))
    full_step, selective_step = _step(full, count=True), _step(selective, count=True)
    _assert_same(full_step, plain)
    _assert_same(selective_step, plain)
    assert plain[2] < selective_step[2] < full_step[2]


@pytest.mark.parametrize("quantized", [False, True])
def test_compiled_checkpointed_layers_match_eager(quantized: bool) -> None:
    """The runner's checkpointing under torch.compile (selective where the checkpoint sits inside the compiled
    layer, whole layers where Transformers checkpoints around it) gives the eager gradients."""
    if quantized:
        pytest.importorskip("torchao")
    lora = {"quantize_base": True, "nf4_block_size": 16, "nf4_scaler_block_size": 2} if quantized else {}
    eager = _step(_model(**lora))
    model = _model(**lora)
    enable_checkpointing(model, compiled=True, offload=False)
    compile_layers(model)
    _assert_same(_step(model), eager)


@pytest.mark.parametrize("inside", [True, False], ids=["checkpoint-in-forward", "checkpoint-around-call"])
def test_the_selective_policy_runs_only_inside_the_compiled_layer(monkeypatch, inside: bool) -> None:
    """Transformers 5.17 checkpoints around the compiled layer, where the policy's cache sits outside the graph
    (a q_proj factor's gradient came out 121 % off): there the layers recompute in full and the run says so."""
    monkeypatch.setattr(checkpointing, "CHECKPOINTS_IN_FORWARD", inside)
    model = _model()
    notes = enable_checkpointing(model, compiled=True, offload=False)
    keywords = model.model.layers[0]._gradient_checkpointing_func.keywords
    assert ("context_fn" in keywords) is inside
    assert (notes == []) is inside
    assert inside or "recomputes whole layers" in notes[0]
