"""Offloaded gradient checkpointing: each layer keeps only its input, in host memory, and recomputes in the
backward; the loss and every LoRA gradient equal full checkpointing's (dropout masks repeat), on the CPU here and
on CUDA (pinned buffers, side-stream copies, one layer of prefetch) on the GPU machine."""

from __future__ import annotations

import pytest
import torch
from test_build import cfg_with
from test_run import losses, make_cfg, run

from loralei.errors import ConfigError
from loralei.train import build
from loralei.train.offload import _CHAIN, OffloadedCheckpoint
from tiny_models import tiny_model


def _loss_and_grads(mode: bool | str, device: torch.device, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = tiny_model("llama", dtype=dtype).to(device)
    cfg = cfg_with(gradient_checkpointing=mode, fused_lora=False)
    cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"lora_dropout": 0.1, "r": 4})})
    build.prepare_model(model, cfg, device)
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


def _same_as_full_checkpointing(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    want_loss, want = _loss_and_grads(True, device)
    pushed = []
    push = _CHAIN.push
    monkeypatch.setattr(_CHAIN, "push", lambda tensor: pushed.append(tensor.shape) or push(tensor))
    got_loss, got = _loss_and_grads("offload", device)
    assert len(pushed) == 2  # both layers went through offload
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys() and want
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert _CHAIN.copies == []  # the pass is over: nothing left in host memory or in flight


def test_offload_trains_like_full_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    _same_as_full_checkpointing(torch.device("cpu"), monkeypatch)


@pytest.mark.gpu
def test_offload_trains_like_full_checkpointing_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _same_as_full_checkpointing(torch.device("cuda"), monkeypatch)


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
        OffloadedCheckpoint()(lambda h, o: h * o, torch.ones(2, requires_grad=True), other)


def test_a_layer_whose_input_needs_no_gradient_still_trains_its_parameters() -> None:
    """The first layer's input comes from a frozen embedding: its own weights must still get gradients."""
    layer = torch.nn.Linear(3, 3)
    hidden = torch.randn(2, 3)  # no gradient wanted
    OffloadedCheckpoint()(layer, hidden).sum().backward()
    want = torch.nn.Linear(3, 3)
    want.load_state_dict(layer.state_dict())
    want(hidden).sum().backward()
    torch.testing.assert_close(layer.weight.grad, want.weight.grad)
    assert hidden.grad is None and _CHAIN.copies == []
