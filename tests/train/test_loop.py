"""One optimizer step: clipping, skipping non-finite steps (on the device where the optimizer can), the loss
handed to SkipStepAdamW, and the verdict read a step later (the schedule follows the applied steps)."""

from __future__ import annotations

import math

import pytest
import torch

from loralei.train.loop import LoopSettings, TrainingError, _optimizer_step, _record_skip, _settle, _Window
from loralei.train.metrics import MetricsLogger
from loralei.train.state import Trainables, TrainState


class RecordingSGD(torch.optim.SGD):
    """SGD that records the keyword arguments of step()."""

    def __init__(self, params, skipped_steps: bool = False):
        super().__init__(params, lr=1.0)
        self.kwargs = []
        if skipped_steps:
            self.skipped_steps = torch.zeros(())

    def step(self, closure=None, **kwargs):
        self.kwargs.append(kwargs)
        return super().step(closure)


def setup(grad: list[float], **opt_kw):
    param = torch.nn.Parameter(torch.zeros(len(grad)))
    param.grad = torch.tensor(grad)
    opt = RecordingSGD([param], **opt_kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    return param, Trainables(torch.nn.Linear(1, 1), opt, sched)


def _settled(objs, verdict, tmp_path) -> TrainState:
    state = TrainState()
    settings = LoopSettings(1, 1, None, 1, None, None, 3, torch.device("cpu"))
    _settle(objs, state, settings, MetricsLogger(tmp_path, 1, enabled=False), _Window(), verdict, 4)
    return state


def test_gradient_is_clipped_to_max_norm(tmp_path):
    param, objs = setup([6.0, 8.0])
    verdict = _optimizer_step(objs, [param], torch.tensor(1.0), max_norm=1.0)
    loss, norm, applied = verdict.read()
    assert applied and loss == 1.0 and norm == pytest.approx(10.0)
    torch.testing.assert_close(param.detach(), torch.tensor([-0.6, -0.8]))
    assert (
        param.grad is None and objs.scheduler.last_epoch == 0
    )  # the schedule moves when the verdict is read
    assert _settled(objs, verdict, tmp_path).skipped_steps == 0 and objs.scheduler.last_epoch == 1


@pytest.mark.parametrize(("grad", "loss"), [([math.inf, 1.0], 1.0), ([1.0, 1.0], math.nan)])
def test_non_finite_step_is_skipped_and_leaves_parameters_and_schedule(grad, loss, tmp_path):
    param, objs = setup(grad)
    verdict = _optimizer_step(objs, [param], torch.tensor(loss), max_norm=None)
    assert not verdict.read()[2] and objs.optimizer.kwargs == []
    assert torch.equal(param.detach(), torch.zeros(2)) and param.grad is None
    assert _settled(objs, verdict, tmp_path).skipped_steps == 1 and objs.scheduler.last_epoch == 0


@pytest.mark.parametrize("finite", [True, False])
def test_fused_adamw_decides_on_the_device(finite, tmp_path):
    """torch's fused AdamW skips through found_inf: the host reads neither loss nor norm to step."""
    param = torch.nn.Parameter(torch.ones(3))
    want = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    reference = torch.optim.AdamW([want], lr=0.1, fused=True)
    objs = Trainables(torch.nn.Linear(1, 1), opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    grad = torch.tensor([1.0, -2.0, 3.0 if finite else math.nan])
    param.grad, want.grad = grad.clone(), grad.clone()
    if finite:
        reference.step()
    verdict = _optimizer_step(objs, [param], torch.tensor(2.0), max_norm=None)
    assert not hasattr(opt, "found_inf")
    assert verdict.read()[2] == finite and torch.equal(param.detach(), want.detach())
    assert float(opt.state[param]["step"]) == float(finite)
    assert _settled(objs, verdict, tmp_path).skipped_steps == int(not finite)
    assert objs.scheduler.last_epoch == int(finite)


def test_skipstep_optimizer_receives_the_loss():
    param, objs = setup([1.0, 1.0], skipped_steps=True)
    loss = torch.tensor(2.5)
    _optimizer_step(objs, [param], loss, max_norm=None)
    assert objs.optimizer.kwargs == [{"loss": loss}]


class CountingSGD(RecordingSGD):
    """Like SkipStepAdamW, ``skipped_steps`` is a property (there it reads a device counter)."""

    reads = 0

    @property
    def skipped_steps(self) -> int:
        CountingSGD.reads += 1
        return 0


def test_the_skip_counter_is_not_read_on_a_step():
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    opt = CountingSGD([param])
    objs = Trainables(torch.nn.Linear(1, 1), opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    loss = torch.tensor(2.5)
    _optimizer_step(objs, [param], loss, max_norm=None)
    assert opt.kwargs == [{"loss": loss}] and CountingSGD.reads == 0


def test_consecutive_skips_stop_training():
    state = TrainState(global_step=7)
    _record_skip(state, stepped=False, limit=2, loss=math.nan, norm=1.0)
    _record_skip(state, stepped=True, limit=2, loss=1.0, norm=1.0)  # a good step resets the streak
    _record_skip(state, stepped=False, limit=2, loss=math.nan, norm=1.0)
    assert state.skipped_steps == 2 and state.consecutive_skips == 1
    with pytest.raises(TrainingError, match="non-finite for 2 consecutive steps"):
        _record_skip(state, stepped=False, limit=2, loss=math.nan, norm=1.0)


@pytest.mark.gpu
def test_a_step_with_fused_adamw_never_waits_for_the_device():
    param = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    param.grad = torch.randn(1024, device="cuda")
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    objs = Trainables(torch.nn.Linear(1, 1), opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    _optimizer_step(
        objs, [param], torch.tensor(2.0, device="cuda"), max_norm=1.0
    ).read()  # state, pinned pool
    param.grad, loss = torch.randn(1024, device="cuda"), torch.tensor(2.0, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verdict = _optimizer_step(objs, [param], loss, max_norm=1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert verdict.read()[2]
