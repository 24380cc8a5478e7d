"""Checkpoint recomputations skip the fused MLP's down projection when nothing reads it (loralei.ops.recompute):
the loss and every LoRA gradient are bit-identical to a recomputation that runs it, with both checkpoint styles
(torch's non-reentrant checkpoint with early stop, and the offloaded one). In a Gemma-2 layer a norm after the
MLP saves the MLP's output, so there it must still be computed: the gradients stay identical there too."""

from __future__ import annotations

import functools

import pytest
import torch
from test_build import cfg_with
from torch.utils.checkpoint import checkpoint

from loralei.kernels import gated_mlp
from loralei.ops import lora_mlp, lowrank_sum, recompute
from loralei.train import build, checkpointing
from loralei.train.checkpointing import RecomputingCheckpoint
from loralei.train.input_checkpoint import InputCheckpoint
from tiny_models import tiny_model

LAYERS = 2  # tiny_model's decoder layers
CPU = torch.device("cpu")


STYLES = (
    "torch",
    "kept",
    "offload",
)  # torch's checkpoint; the input-only one, input on the device / on the host


def _model(family: str, dropout: float, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_model(family)
    cfg = cfg_with(gradient_checkpointing=True, fused_lora=True)
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"lora_dropout": dropout, "r": 4})})
    build.prepare_model(model, cfg, device)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)  # B = 0 at init would leave A's gradient zero
    return model.train()


def _install(model: torch.nn.Module, style: str, skip: bool) -> object:
    """Makes every layer call one checkpoint function of ``style``, skipping the unread output or not (the
    reference: torch's checkpoint as Transformers calls it, or the input-only one that never defers)."""
    kwargs = {"use_reentrant": False}
    if style == "torch":
        func = RecomputingCheckpoint(kwargs) if skip else functools.partial(checkpoint, **kwargs)
    else:
        func = InputCheckpoint(offload=style == "offload")
        func.defer_outputs = skip
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = func
    return func


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)
    torch.manual_seed(2)  # the dropout masks
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


class _Calls:
    """Counts calls of a function of a module."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, module: object) -> None:
        self.count, inner = 0, getattr(module, name)

        def spy(*args, **kwargs):
            self.count += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)


class _DownOutputs:
    """Counts the fused MLP's down-projection outputs (``lora_output`` in loralei.ops.lora_mlp): ``fills`` are
    those a recomputation deferred and filled later, ``eager`` those a forward computed at once."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.outputs = _Calls(monkeypatch, "lora_output", lora_mlp)
        # where the forward hands down's LoRA term to the residual add instead (fusion.mlp, on CUDA)
        self.handed = _Calls(monkeypatch, "lowrank_sum", lowrank_sum)
        self.fills, defer = 0, recompute.defer

        def counted(out: torch.Tensor, fill):
            def filled():
                self.fills += 1
                return fill()

            return defer(out, filled)

        monkeypatch.setattr(recompute, "defer", counted)

    @property
    def eager(self) -> int:
        return self.outputs.count - self.fills


def _compare(
    family: str,
    style: str,
    monkeypatch: pytest.MonkeyPatch,
    dropout: float = 0.1,
    device: torch.device = CPU,
) -> tuple[_DownOutputs, object]:
    reference = _model(family, dropout, device)
    _install(reference, style, skip=False)
    want_loss, want = _loss_and_grads(reference)
    model = _model(family, dropout, device)
    func = _install(model, style, skip=True)
    outputs = _DownOutputs(monkeypatch)
    got_loss, got = _loss_and_grads(model)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
    return outputs, func


@pytest.mark.parametrize("style", STYLES)
def test_the_recomputation_skips_the_down_projection_of_a_llama_layer(monkeypatch, style) -> None:
    outputs, func = _compare("llama", style, monkeypatch)
    assert outputs.eager == LAYERS  # the forward's only: no recomputation ran the down projection
    assert outputs.fills == 0
    assert getattr(func, "defer_outputs", True)


def test_a_norm_after_the_mlp_gets_the_real_output_under_early_stop(monkeypatch) -> None:
    outputs, _ = _compare("gemma2", "torch", monkeypatch)
    assert outputs.eager == LAYERS
    assert outputs.fills == LAYERS  # each recomputation filled the deferred output before the norm read it


@pytest.mark.parametrize("style", ["kept", "offload"])
def test_a_norm_after_the_mlp_makes_the_input_only_checkpoint_recompute_in_full(monkeypatch, style) -> None:
    outputs, func = _compare("gemma2", style, monkeypatch)
    assert (
        not func.defer_outputs
    )  # the first recomputation saw the norm save a tensor and turned deferral off
    # forward (2 layers), the deferring recomputation of the last layer (deferred: no call), then the full
    # recomputation of both layers
    assert outputs.eager == 2 * LAYERS
    assert outputs.fills == 0


def test_early_stop_off_fills_every_output(monkeypatch) -> None:
    """Without torch's early stop the recomputation always goes on past the MLP: the output is filled."""
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        outputs, _ = _compare("llama", "torch", monkeypatch)
    assert (outputs.eager, outputs.fills) == (LAYERS, LAYERS)


def _skips_with_the_mlp_kernels(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """Without dropout on the MLP the Triton MLP kernels run (h is formed in the kernel): the skip holds there."""
    kernels = _Calls(monkeypatch, "gated_mlp_forward", gated_mlp)
    for style in STYLES:
        kernels.count = 0
        outputs, _ = _compare("llama", style, monkeypatch, dropout=0.0, device=device)
        # each layer's output formed once, in the forward: at once, or (input-only checkpoints on CUDA) handed
        # to the residual add; no recomputation filled one
        assert (outputs.eager + outputs.handed.count, outputs.fills) == (LAYERS, 0)
        assert kernels.count == 4 * LAYERS  # two models, each a forward and a recomputation per layer


def test_the_skip_with_the_mlp_kernels_in_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not gated_mlp.interpreter_runs_loops():
        pytest.skip("this Triton's interpreter cannot run loops with run-time bounds")
    _skips_with_the_mlp_kernels(monkeypatch, CPU)


@pytest.mark.gpu
def test_the_skip_with_the_mlp_kernels_on_cuda(monkeypatch) -> None:
    _skips_with_the_mlp_kernels(monkeypatch, torch.device("cuda"))


@pytest.mark.parametrize(
    ("training", "processes", "want"),
    [
        ({"gradient_checkpointing": True}, 1, InputCheckpoint),
        ({"gradient_checkpointing": True}, 2, RecomputingCheckpoint),
        ({"gradient_checkpointing": "offload"}, 1, InputCheckpoint),
        ({"gradient_checkpointing": True, "torch_compile": True}, 1, functools.partial),
    ],
)
def test_each_setting_picks_its_checkpoint_function(monkeypatch, training, processes, want) -> None:
    monkeypatch.setattr(checkpointing.distributed, "world_size", lambda: processes)
    monkeypatch.setattr(build, "compile_layers", lambda model: "")  # the choice alone, not the compile
    model = tiny_model("llama")
    build.prepare_model(model, cfg_with(**training), CPU)
    (func,) = {
        m._gradient_checkpointing_func for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")
    }
    assert isinstance(func, want)
    if isinstance(func, InputCheckpoint):
        assert func.offload == (training["gradient_checkpointing"] == "offload")
        assert isinstance(func.fallback, RecomputingCheckpoint) != func.offload
