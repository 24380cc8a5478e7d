"""Input-only checkpointing: each layer keeps only its input, on the device (``gradient_checkpointing: true`` in
one process) or in host memory (``offload``), and recomputes in the backward; the loss and every LoRA gradient
equal torch's checkpoint's (dropout masks repeat), on the CPU here and on CUDA (pinned buffers, side-stream
copies, one layer of prefetch) on the GPU machine."""

from __future__ import annotations

import functools

import pytest
import torch
from test_build import cfg_with
from test_run import losses, make_cfg, run
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from loralei.errors import ConfigError
from loralei.train import build
from loralei.train.input_checkpoint import _CHAIN, InputCheckpoint, _Chain
from tiny_models import tiny_model, tiny_moe_model


def _loss_and_grads(mode: bool | str, device: torch.device, dtype: torch.dtype = torch.float32):
    """``mode``: a gradient_checkpointing value, or "torch" for torch's checkpoint as Transformers calls it."""
    torch.manual_seed(0)
    model = tiny_model("llama", dtype=dtype).to(device)
    cfg = cfg_with(gradient_checkpointing=True if mode == "torch" else mode, fused_lora=False)
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"lora_dropout": 0.1, "r": 4})})
    build.prepare_model(model, cfg, device)
    if mode == "torch":
        for module in model.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    model.train()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)  # B = 0 at init would leave A's gradient zero
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    torch.manual_seed(2)  # the dropout masks
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _same_as_torch_checkpointing(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    want_loss, want = _loss_and_grads("torch", device)
    pushed = []
    push = _CHAIN.push
    monkeypatch.setattr(
        _CHAIN, "push", lambda tensor, offload: pushed.append(offload) or push(tensor, offload)
    )
    for mode in (True, "offload"):
        pushed.clear()
        got_loss, got = _loss_and_grads(mode, device)
        assert (
            pushed == [mode == "offload"] * 2
        )  # both layers kept only their input, on the host with offload
        torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
        assert got.keys() == want.keys() and want
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)
        assert _CHAIN.copies == []  # the pass is over: nothing left in host memory or in flight
    if device.type == "cuda":  # each of the 2 layers' fp32 inputs (2 x 24 tokens x 32) in a pinned buffer
        assert _CHAIN.host_bytes() >= 2 * (2 * 24 * 32 * 4)


def test_input_only_checkpointing_trains_like_torch_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    _same_as_torch_checkpointing(torch.device("cpu"), monkeypatch)


@pytest.mark.gpu
def test_input_only_checkpointing_trains_like_torch_checkpointing_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _same_as_torch_checkpointing(torch.device("cuda"), monkeypatch)


def _moe_loss_and_grads(mode: bool | str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The tiny Qwen3-MoE with fused LoRA on q/k/v/o and both expert banks, one forward and backward under
    ``gradient_checkpointing: mode``."""
    torch.manual_seed(0)
    model = tiny_moe_model()
    cfg = cfg_with(gradient_checkpointing=mode)
    banks = ["experts.gate_up_proj", "experts.down_proj"]
    lora = {"r": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "target_parameters": banks}
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update=lora)})
    build.prepare_model(model, cfg, torch.device("cpu"))
    model.train()
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", [True, "offload"])
def test_moe_layers_under_input_only_checkpointing_train_as_without(mode: bool | str) -> None:
    """The fused experts op keeps its values in the checkpoint's recomputation and leaves the unread output
    unfilled there: the loss and every gradient (expert factors included) are those of the run without
    checkpointing."""
    want_loss, want = _moe_loss_and_grads(False)
    got_loss, got = _moe_loss_and_grads(mode)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys() and any("experts" in name for name in want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_another_argument_that_needs_a_gradient_goes_to_the_fallback() -> None:
    other = torch.ones(2, requires_grad=True)
    calls = []
    fallback = functools.partial(checkpoint, use_reentrant=False)
    layer = InputCheckpoint(offload=False, fallback=lambda *a, **k: calls.append(1) or fallback(*a, **k))
    hidden = torch.ones(2, requires_grad=True)
    layer(lambda h, o: h * o, hidden, other).sum().backward()
    assert calls == [1] and torch.equal(other.grad, torch.ones(2)) and _CHAIN.copies == []


def test_a_run_with_offload_repeats_one_with_checkpointing(tmp_path) -> None:
    run(make_cfg(tmp_path / "full", training={"gradient_checkpointing": True}))
    run(make_cfg(tmp_path / "offload", training={"gradient_checkpointing": "offload"}))
    assert losses(tmp_path / "offload") == pytest.approx(losses(tmp_path / "full"), rel=1e-6)


@pytest.mark.parametrize(
    ("training", "message"),
    [
        ({"torch_compile": True}, "offload does not run under torch_compile yet"),
        ({"distributed": "fsdp2"}, "offload does not run with distributed: fsdp2 yet"),
    ],
)
def test_unsupported_combinations_are_named(tmp_path, training, message) -> None:
    with pytest.raises(ConfigError, match=message):
        make_cfg(tmp_path, training={"gradient_checkpointing": "offload", **training})


def test_another_argument_that_needs_a_gradient_is_refused() -> None:
    other = torch.ones(2, requires_grad=True)
    with pytest.raises(ConfigError, match="another tensor that needs one"):
        InputCheckpoint(offload=True)(lambda h, o: h * o, torch.ones(2, requires_grad=True), other)


def test_a_layer_whose_input_needs_no_gradient_still_trains_its_parameters() -> None:
    """The first layer's input comes from a frozen embedding: its own weights must still get gradients."""
    layer = torch.nn.Linear(3, 3)
    hidden = torch.randn(2, 3)  # no gradient wanted
    InputCheckpoint(offload=True)(layer, hidden).sum().backward()
    want = torch.nn.Linear(3, 3)
    want.load_state_dict(layer.state_dict())
    want(hidden).sum().backward()
    torch.testing.assert_close(layer.weight.grad, want.weight.grad)
    assert hidden.grad is None and _CHAIN.copies == []


def test_with_offload_no_layer_input_stays_in_memory_until_the_backward() -> None:
    """Offloaded, the first layer's input (a frozen embedding's output, which needs no gradient) is not held by
    the graph until the step's end: only its host copy is."""
    layer = torch.nn.Linear(3, 3)
    hidden = torch.randn(2, 3)
    storage = StorageWeakRef(hidden.untyped_storage())
    out = InputCheckpoint(offload=True)(layer, hidden)
    del hidden
    assert storage.expired()
    out.sum().backward()
    assert layer.weight.grad is not None and _CHAIN.copies == []


def test_without_gradients_a_layer_runs_as_it_is_and_keeps_nothing() -> None:
    """A forward under no_grad (DPO's reference pass, evaluation in training mode) has no backward to keep
    anything for: the layer runs directly, nothing goes to host memory."""
    layer = torch.nn.Linear(3, 3)
    hidden = torch.randn(2, 3)
    with torch.no_grad():
        out = InputCheckpoint(offload=True)(layer, hidden)
    torch.testing.assert_close(out, layer(hidden), rtol=0, atol=0)
    assert _CHAIN.copies == []


def test_a_pass_dropped_without_its_backward_frees_its_inputs() -> None:
    """A training forward whose graph is dropped (no backward) leaves nothing behind in the chain: the next pass
    starts at position 0 and trains as usual."""
    layer = torch.nn.Linear(3, 3)
    func = InputCheckpoint(offload=False)
    hidden = torch.randn(2, 3, requires_grad=True)
    dropped = func(layer, func(layer, hidden))
    assert len(_CHAIN.copies) == 2 and all(ref() is not None for ref in _CHAIN.copies)
    del dropped
    assert all(ref() is None for ref in _CHAIN.copies)  # the inputs went with the graph
    out = func(layer, func(layer, hidden))
    assert len(_CHAIN.copies) == 2
    out.sum().backward()
    assert _CHAIN.copies == [] and layer.weight.grad is not None


def test_a_pinned_buffer_a_cuda_graph_captured_outlives_its_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    """A longer batch grows a layer position's pinned buffer; one that a graph captured stays allocated, as its
    replays still copy into it (CUDA's pinned allocation and capture state stood in for on the CPU)."""
    capturing = {"on": False}
    monkeypatch.setattr(torch, "empty", lambda n, dtype=None, pin_memory=False: torch.zeros(n, dtype=dtype))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])

    class LayerInput:
        device, dtype = torch.device("cuda"), torch.bfloat16

        def __init__(self, n: int) -> None:
            self.n = n

        def numel(self) -> int:
            return self.n

    chain = _Chain()
    eager = chain._buffer(LayerInput(8), (0, 0))
    capturing["on"] = True
    captured = chain._buffer(LayerInput(8), (0, 0))
    capturing["on"] = False
    grown = chain._buffer(LayerInput(20), (0, 0))
    assert captured is eager and grown is not captured and grown.numel == 32  # 40 bytes: one 64-byte piece
    assert list(chain.captured.values()) == [captured]
    assert (
        chain._buffer(LayerInput(4), (0, 0)) is grown and len(chain.captured) == 1
    )  # eager reuse captures nothing
    assert chain.host_bytes() == 64 + 16  # the grown buffer and the captured one, bf16
