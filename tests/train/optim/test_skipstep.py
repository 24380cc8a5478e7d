import math

import pytest
import torch

from loralei.train.optim import OptionError, SkipStepAdamW

SHAPES = [(6, 5), (4,), (3, 7)]


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _copies(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


def _grads(step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def _loss(step: int) -> torch.Tensor:
    # A smoothly falling loss with a little noise, like a real run's.
    return torch.tensor(3.0 - 0.01 * step + 0.02 * math.sin(step))


def _set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()


def _snapshot(opt: SkipStepAdamW, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor the optimizer owns or updates, except the skip counters."""
    tensors = [p.detach().clone() for p in params]
    for p in params:
        tensors += [t.clone() for t in opt.state[p].values()]
    detector = opt.extra_state()["skip_detector"]
    tensors += [t.clone() for name in ("loss", "grad_norm") for t in detector[name].values()]
    return tensors


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("variant", ["fused", "foreach", "for-loop"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_equals_torch_adamw_when_nothing_is_skipped(variant: str, weight_decay: float) -> None:
    """Bit for bit against torch's fused AdamW (the same kernel); to rounding against its other two paths."""
    ref_params, params = _params(), _params()
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}]  # noqa: E731
    path = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[variant]
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, weight_decay=weight_decay, **path)
    opt = SkipStepAdamW(groups(params), lr=1e-2, weight_decay=weight_decay, warmup=4, window=8)
    for step in range(40):
        grads = _grads(step)
        _set_grads(ref_params, grads)
        _set_grads(params, grads)
        ref.step()
        opt.step(loss=_loss(step))
    assert opt.skipped_steps == 0
    same = torch.equal if variant == "fused" else lambda x, y: torch.allclose(x, y, rtol=1e-5, atol=1e-7)
    for p, q in zip(params, ref_params, strict=True):
        assert same(p, q)
        assert same(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
        assert same(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        assert opt.state[p]["step"].item() == ref.state[q]["step"].item() == 40


def _warmed_up(params: list[torch.Tensor], steps: int = 20) -> SkipStepAdamW:
    opt = SkipStepAdamW(params, lr=1e-2, weight_decay=0.05, warmup=8, window=16)
    for step in range(steps):
        _set_grads(params, _grads(step))
        opt.step(loss=_loss(step))
    assert opt.skipped_steps == 0
    return opt


@pytest.mark.parametrize(
    ("kind", "loss", "grad_scale"),
    [("loss spike", 30.0, 1.0), ("grad-norm spike", None, 1e3), ("NaN loss", math.nan, 1.0)],
)
def test_outlier_step_changes_nothing_and_is_counted(
    kind: str, loss: float | None, grad_scale: float
) -> None:
    params = _params()
    opt = _warmed_up(params)
    before = _snapshot(opt, params)
    _set_grads(params, _grads(99, scale=grad_scale))
    opt.step(loss=None if loss is None else torch.tensor(loss))
    _assert_same(_snapshot(opt, params), before)  # params, moments, step counts and windows untouched
    assert opt.skipped_steps == 1, kind
    assert bool(opt.last_step_skipped)


def test_nan_gradient_is_skipped_from_the_first_step() -> None:
    params = _params()
    opt = SkipStepAdamW(params, lr=1e-2)
    grads = _grads(0)
    grads[1][2] = math.nan
    _set_grads(params, grads)
    before = [p.detach().clone() for p in params]
    opt.step(loss=_loss(0))
    _assert_same([p.detach() for p in params], before)
    assert opt.skipped_steps == 1
    assert all(opt.state[p]["step"].item() == 0 for p in params)
    assert all(torch.isfinite(opt.state[p]["exp_avg"]).all() for p in params)


@pytest.mark.parametrize("spike", ["huge", "nan", "inf"])
def test_a_skipped_step_is_exactly_a_missing_step(spike: str) -> None:
    """After a spike (or a non-finite gradient), training continues as if that step had never happened."""
    params = _params()
    ref_params = _copies(params)
    opt = SkipStepAdamW(params, lr=1e-2, weight_decay=0.1, warmup=8, window=16)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(30):
        if step == 20:  # the spike: only the skipping optimizer sees it
            grads = _grads(step, scale=1e4)
            if spike != "huge":
                grads[0][1, 2] = math.nan if spike == "nan" else math.inf
            _set_grads(params, grads)
            opt.step(loss=_loss(step))
            continue
        _set_grads(params, _grads(step))
        _set_grads(ref_params, _grads(step))
        opt.step(loss=_loss(step))
        ref.step()
    assert opt.skipped_steps == 1
    _assert_same([p.detach() for p in params], [p.detach() for p in ref_params])
    for p, q in zip(params, ref_params, strict=True):
        _assert_same(
            [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq", "step")],
            [ref.state[q][k] for k in ("exp_avg", "exp_avg_sq", "step")],
        )


def test_pre_clip_grad_norm_is_what_gets_tested() -> None:
    params = _params()
    opt = _warmed_up(params)
    _set_grads(params, _grads(99, scale=1e3))
    pre_clip = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    opt.step(loss=_loss(20), grad_norm=pre_clip)
    assert opt.skipped_steps == 1


def test_step_never_reads_device_values_on_the_host(no_host_sync) -> None:
    with no_host_sync(), pytest.raises(AssertionError, match="host sync"):
        bool(torch.ones(()) > 0)  # the guard itself works
    params = _params()
    opt = SkipStepAdamW(params, lr=1e-2, warmup=4, window=8)
    with no_host_sync():
        for step in range(10):
            _set_grads(params, _grads(step, scale=1e4 if step == 8 else 1.0))
            opt.step(loss=_loss(step))
    assert opt.skipped_steps == 1


def test_state_dict_round_trip_keeps_the_rolling_windows() -> None:
    params = _params()
    opt = _warmed_up(params)
    resumed_params = _copies(params)
    resumed = SkipStepAdamW(resumed_params, lr=1e-2, weight_decay=0.05, warmup=8, window=16)
    resumed.load_state_dict(opt.state_dict())
    for step in range(20, 26):
        scale = 1e3 if step == 23 else 1.0
        for ps, o in ((params, opt), (resumed_params, resumed)):
            _set_grads(ps, _grads(step, scale))
            o.step(loss=_loss(step))
    assert resumed.skipped_steps == opt.skipped_steps == 1  # the loaded windows recognised the spike
    _assert_same([p.detach() for p in resumed_params], [p.detach() for p in params])


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"sigma": 0.0}, "sigma"),
        ({"window": 1}, "window"),
        ({"warmup": 20, "window": 10}, "warmup"),
        ({"lr": -1}, "lr"),
    ],
)
def test_bad_options_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(OptionError, match=f"^{field}:") as err:
        SkipStepAdamW(_params(), **options)
    assert err.value.field == field
