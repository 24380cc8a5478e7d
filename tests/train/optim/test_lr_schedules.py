import itertools
import math

import pytest
import torch

from loralei import ConfigError
from loralei.train.optim import SCHEDULES, build_scheduler

PEAK, WARMUP, TOTAL, FLOOR = 0.1, 4, 20, 0.1


def _lrs(schedule: str, steps: int = TOTAL + 2, **overrides) -> list[float]:
    """The LR each optimizer step runs with, stepping the scheduler once per step as the loop does."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    settings = {"warmup_steps": WARMUP, "total_steps": TOTAL, "min_lr_ratio": FLOOR} | overrides
    sched = build_scheduler(opt, schedule=schedule, **settings)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warmup_is_linear_and_reaches_the_peak_at_warmup_steps(schedule: str) -> None:
    lrs = _lrs(schedule)
    assert lrs[:WARMUP] == pytest.approx([PEAK * k / (WARMUP + 1) for k in range(1, WARMUP + 1)])
    assert lrs[WARMUP] == pytest.approx(PEAK)


@pytest.mark.parametrize(
    ("schedule", "halfway", "end"),
    [
        ("cosine", FLOOR + (1 - FLOOR) * 0.5, FLOOR),
        ("linear", FLOOR + (1 - FLOOR) * 0.5, FLOOR),
        ("constant", 1, 1),
    ],
)
def test_decay_at_key_steps(schedule: str, halfway: float, end: float) -> None:
    lrs = _lrs(schedule)
    middle = WARMUP + (TOTAL - WARMUP) // 2
    assert lrs[middle] == pytest.approx(PEAK * halfway)
    assert lrs[TOTAL] == pytest.approx(PEAK * end)
    assert lrs[TOTAL + 1] == pytest.approx(PEAK * end)  # stays at the floor past the planned end


def test_cosine_and_linear_shapes_differ_between_key_steps() -> None:
    quarter = WARMUP + (TOTAL - WARMUP) // 4
    cosine, linear = _lrs("cosine")[quarter], _lrs("linear")[quarter]
    assert cosine == pytest.approx(PEAK * (FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi / 4))))
    assert linear == pytest.approx(PEAK * (FLOOR + (1 - FLOOR) * 0.75))


def test_no_warmup_starts_at_the_peak_and_decays_monotonically() -> None:
    lrs = _lrs("cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lrs[0] == pytest.approx(PEAK)
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert lrs[TOTAL] == pytest.approx(0.0)


def test_state_dict_resumes_the_same_sequence() -> None:
    full = _lrs("cosine")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    sched = build_scheduler(
        opt, schedule="cosine", warmup_steps=WARMUP, total_steps=TOTAL, min_lr_ratio=FLOOR
    )
    for _ in range(7):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
    opt2 = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    sched2 = build_scheduler(opt2, schedule="linear", warmup_steps=0, total_steps=3)  # settings get replaced
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    resumed = []
    for _ in range(TOTAL + 2 - 7):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == pytest.approx(full[7:])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"schedule": "cosin"}, 'optimizer.schedule: .*did you mean "cosine"'),
        ({"warmup_steps": 30}, "optimizer.warmup_steps: must not exceed"),
        ({"warmup_steps": -1}, "optimizer.warmup_steps: must be an integer >= 0"),
        ({"total_steps": 0}, "total_steps: must be an integer >= 1"),
        ({"min_lr_ratio": 1.5}, r"optimizer.min_lr_ratio: must be a number in \[0, 1\]"),
    ],
)
def test_bad_settings_name_the_field(settings: dict, message: str) -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=PEAK)
    given = {"schedule": "cosine", "warmup_steps": WARMUP, "total_steps": TOTAL} | settings
    with pytest.raises(ConfigError, match=message):
        build_scheduler(opt, **given)
