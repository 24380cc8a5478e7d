import pytest
import torch

from loralei.train.optim import OptionError, PoLoRA
from loralei.train.optim.polora import preconditioned_grads

OUT, IN, R = 9, 7, 3
LR = 1e-2
DELTA = 1e-12  # the damping breaks the invariance by O(δ); keep it far below the tolerance


def _factors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(R, IN, generator=g, dtype=torch.float64)
    b = torch.randn(OUT, R, generator=g, dtype=torch.float64)
    return a, b


def _loss(product: torch.Tensor) -> torch.Tensor:
    """A non-quadratic loss of the adapted weight's update (so G = ∂f/∂W depends on W)."""
    g = torch.Generator().manual_seed(7)
    target = torch.randn(OUT, IN, generator=g, dtype=torch.float64)
    return ((product - target) ** 2).sum() + (product**4).sum() / 10


def _product_update(
    a: torch.Tensor, b: torch.Tensor, scale: float, optimizer: str, **options
) -> torch.Tensor:
    """The first-order change of the product, s·(ΔB·A + B·ΔA), after one step from (A, B).

    ``optimizer`` is "polora" (scaled GD) or "sgd" (plain gradient descent). The first-order part is exactly
    linear in the learning rate, so invariances of "ΔW up to O(lr²)" show up here to rounding error.
    """
    a0, b0 = a, b
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    if optimizer == "polora":
        opt = PoLoRA([(a, b)], lr=LR, delta=DELTA, scale=scale, mode="sgd", **options)
    else:
        opt = torch.optim.SGD([a, b], lr=LR)
    _loss(scale * b @ a).backward()
    opt.step()
    return scale * ((b - b0) @ a0 + b0 @ (a - a0)).detach()


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.allclose(x, y, rtol=1e-7, atol=1e-7 * x.abs().max().item())


def _invertible(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, R, generator=g, dtype=torch.float64) + 2 * torch.eye(R, dtype=torch.float64)


@pytest.mark.parametrize("transform", ["scalar", "matrix"])
def test_product_update_does_not_depend_on_how_the_product_is_split(transform: str) -> None:
    a, b = _factors()
    m = torch.eye(R, dtype=torch.float64) * 5.0 if transform == "scalar" else _invertible(3)
    a2, b2 = m @ a, b @ torch.linalg.inv(m)  # same product B·A
    assert torch.allclose(b2 @ a2, b @ a)
    reference = _product_update(a, b, 1.5, "polora")
    assert _close(_product_update(a2, b2, 1.5, "polora"), reference)
    # Plain gradient descent does depend on the split; without this the check above would prove nothing.
    assert not _close(_product_update(a2, b2, 1.5, "sgd"), _product_update(a, b, 1.5, "sgd"))


def test_scale_invariant_update_does_not_depend_on_the_lora_scale() -> None:
    a, b = _factors()
    s1, s2 = 2.0, 0.25
    b2 = b * (s1 / s2)  # s2·B2·A == s1·B·A
    invariant = _product_update(a, b, s1, "polora", scale_invariant=True)
    assert _close(_product_update(a, b2, s2, "polora", scale_invariant=True), invariant)
    # Without folding s into the preconditioner the product's update grows with s².
    plain_1 = _product_update(a, b, s1, "polora")
    plain_2 = _product_update(a, b2, s2, "polora")
    assert _close(plain_2 * (s1 / s2) ** 2, plain_1)
    assert _close(plain_1, invariant * s1**2)


def test_preconditioned_gradients_transform_like_the_factors() -> None:
    """(A, B) → (M·A, B·M⁻¹) maps Ĝ_A → M·Ĝ_A and Ĝ_B → Ĝ_B·M⁻¹: the basis of the invariance in both modes."""
    a, b = _factors()
    m = _invertible(5)
    results = []
    for fa, fb in ((a, b), (m @ a, b @ torch.linalg.inv(m))):
        fa, fb = fa.clone().requires_grad_(), fb.clone().requires_grad_()
        _loss(0.5 * fb @ fa).backward()
        group = {"params": [fa, fb], "scale": 0.5, "scale_invariant": True, "delta": DELTA}
        grads = preconditioned_grads(group)
        results.append((grads[fa], grads[fb]))
    (ga, gb), (ga2, gb2) = results
    assert _close(ga2, m @ ga)
    assert _close(gb2, gb @ torch.linalg.inv(m))


def test_adamw_mode_is_adamw_when_both_grams_are_the_identity() -> None:
    g = torch.Generator().manual_seed(2)
    a = torch.linalg.qr(torch.randn(IN, R, generator=g, dtype=torch.float64)).Q.T.contiguous()  # A·Aᵀ = I
    b = torch.linalg.qr(torch.randn(OUT, R, generator=g, dtype=torch.float64)).Q.contiguous()  # BᵀB = I
    runs = []
    for optimizer in ("polora", "adamw"):
        fa, fb = a.clone().requires_grad_(), b.clone().requires_grad_()
        if optimizer == "polora":
            opt = PoLoRA([(fa, fb)], lr=1e-2, weight_decay=0.1, delta=DELTA)
        else:
            opt = torch.optim.AdamW([fa, fb], lr=1e-2, weight_decay=0.1)
        _loss(fb @ fa).backward()
        opt.step()
        runs.append((fa.detach(), fb.detach()))
    (pa, pb), (ra, rb) = runs
    assert torch.allclose(pa, ra, rtol=1e-9, atol=1e-12)
    assert torch.allclose(pb, rb, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("mode", "lr"), [("adamw", 5e-2), ("sgd", 1e-1)])
def test_fits_a_low_rank_regression(mode: str, lr: float) -> None:
    g = torch.Generator().manual_seed(0)
    scale = 2.0
    target = torch.randn(OUT, R, generator=g) @ torch.randn(R, IN, generator=g) / 3
    x = torch.randn(64, IN, generator=g)
    a = torch.nn.Parameter(torch.randn(R, IN, generator=g) * 0.3)
    b = torch.nn.Parameter(torch.zeros(OUT, R))  # LoRA's zero start: BᵀB = 0, only δ keeps it invertible
    opt = PoLoRA([(a, b)], lr=lr, scale=scale, mode=mode, scale_invariant=True, momentum=0.0)
    losses = []
    for _ in range(200):
        loss = ((x @ (scale * b @ a).T - x @ target.T) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] / 1000


def test_plain_params_group_gets_unpreconditioned_adamw() -> None:
    a, b = (t.float().requires_grad_() for t in _factors())
    extra = torch.randn(5, requires_grad=True)
    twin = extra.detach().clone().requires_grad_()
    opt = PoLoRA([{"pairs": [(a, b)]}, {"params": [extra]}], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(5):
        for p in (a, b, extra, twin):
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        opt.step()
        ref.step()
    assert torch.equal(extra, twin)


def _mixed_pairs(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs of three shapes (two ranks), interleaved, each factor with its own random gradient."""
    g = torch.Generator().manual_seed(4)
    shapes = [(3, 7, 9), (2, 5, 4), (3, 7, 9), (3, 6, 9), (2, 5, 4), (3, 7, 9)]  # (r, in, out)
    pairs = []
    for r, fan_in, fan_out in shapes:
        a = torch.randn(r, fan_in, generator=g).to(dtype).requires_grad_()
        b = torch.randn(fan_out, r, generator=g).to(dtype).requires_grad_()
        a.grad, b.grad = (
            torch.randn(a.shape, generator=g).to(dtype),
            torch.randn(b.shape, generator=g).to(dtype),
        )
        pairs.append((a, b))
    return pairs


def _group(pairs: list) -> dict:
    return {
        "params": [t for pair in pairs for t in pair],
        "scale": 2.0,
        "scale_invariant": True,
        "delta": 1e-3,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_preconditioning_equals_pair_by_pair(dtype: torch.dtype) -> None:
    pairs = _mixed_pairs(dtype)
    pairs[1][0].grad = None  # one pair with only B's gradient: it gets no Ĝ_A, and its bucket is its own
    together = preconditioned_grads(_group(pairs))
    assert set(together) == {t for pair in pairs for t in pair if t.grad is not None}
    for pair in pairs:
        alone = preconditioned_grads(_group([pair]))
        for factor, scaled in alone.items():
            assert together[factor].dtype == factor.dtype
            torch.testing.assert_close(together[factor], scaled, rtol=1e-5, atol=1e-6)
            # and against the formula, written out for this one pair in float64
            a, b = (t.detach().double() for t in pair)
            if factor is pair[0]:
                expected = torch.linalg.solve(4.0 * b.T @ b + 1e-3 * torch.eye(len(a)), pair[0].grad.double())
            else:
                expected = torch.linalg.solve(
                    4.0 * a @ a.T + 1e-3 * torch.eye(len(a)), pair[1].grad.double().T
                ).T
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(scaled.double(), expected, rtol=tol, atol=tol)


def test_step_never_reads_device_values_on_the_host(no_host_sync) -> None:
    a, b = (t.float().requires_grad_() for t in _factors())
    opt = PoLoRA([(a, b)], lr=1e-3)
    with no_host_sync():
        for _ in range(3):
            opt.zero_grad()
            _loss(b @ a).backward()
            opt.step()


@pytest.mark.parametrize("options", [{"mode": "adamw"}, {"mode": "sgd", "momentum": 0.9}])
def test_state_dict_round_trip(options: dict) -> None:
    a, b = (t.float().requires_grad_() for t in _factors())
    opt = PoLoRA([(a, b)], lr=1e-3, **options)
    _loss(b @ a).backward()
    opt.step()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    resumed = PoLoRA([(a2, b2)], lr=1e-3, **options)
    resumed.load_state_dict(opt.state_dict())  # the live state: stepping one must not move the other
    for _ in range(2):
        for fa, fb, o in ((a, b, opt), (a2, b2, resumed)):
            o.zero_grad()
            _loss(fb @ fa).backward()
            o.step()
    assert torch.equal(a, a2)
    assert torch.equal(b, b2)


@pytest.mark.parametrize(
    ("params", "options", "field"),
    [
        ("pairs", {"delta": 0.0}, "delta"),
        ("pairs", {"mode": "adam"}, "mode"),
        ("pairs", {"momentum": 1.0}, "momentum"),
        ("pairs", {"scale_invariant": "yes"}, "scale_invariant"),
        ("pairs", {"scale": -1.0}, "scale"),
        ("mismatched", {}, "pairs[0]"),
        ("both", {}, "params"),
    ],
)
def test_bad_input_names_the_field(params: str, options: dict, field: str) -> None:
    a, b = (t.float().requires_grad_() for t in _factors())
    given = {
        "pairs": [(a, b)],
        "mismatched": [(a, b.T)],
        "both": [{"pairs": [(a, b)], "params": [a]}],
    }[params]
    with pytest.raises(OptionError) as err:
        PoLoRA(given, **options)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")
