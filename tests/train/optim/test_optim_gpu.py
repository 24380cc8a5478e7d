"""The same optimizers on CUDA, where a host sync is real: torch's sync debug mode turns any into an error."""

from collections.abc import Iterator

import pytest
import torch

from loralei.train.optim import PoLoRA, SkipStepAdamW, build_optimizer

pytestmark = pytest.mark.gpu
SHAPES = [(64, 48), (48,), (8, 96)]


@pytest.fixture
def sync_errors() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, device="cuda", generator=g).requires_grad_() for s in SHAPES]


def _set_grads(params: list[torch.Tensor], step: int, scale: float = 1.0) -> None:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * scale


def test_skipstepadamw_never_syncs_and_equals_torch_fused_adamw(sync_errors: None) -> None:
    params, ref_params = _params(), _params()
    opt = SkipStepAdamW(params, lr=1e-2, weight_decay=0.1, warmup=4, window=8)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(24):
        spike = step in (15, 18)
        _set_grads(params, step, scale=1e4 if spike else 1.0)
        if step == 18:
            params[0].grad[3, 5].fill_(float("nan"))  # no host copy; must not leak into params or moments
        loss = torch.full((), 3.0 - 0.01 * step, device="cuda")
        opt.step(loss=loss, grad_norm=torch.nn.utils.clip_grad_norm_(params, 1e6))
        if not spike:
            _set_grads(ref_params, step)
            ref.step()
    torch.cuda.set_sync_debug_mode("default")
    assert opt.skipped_steps == 2
    for p, q in zip(params, ref_params, strict=True):  # the same fused kernel on the same inputs
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("b_lr_ratio", [1.0, 4.0])  # LoRA+: B steps at 4 x lr
def test_polora_never_syncs_and_fits(sync_errors: None, b_lr_ratio: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    target = (
        torch.randn(96, 4, device="cuda", generator=g) @ torch.randn(4, 80, device="cuda", generator=g) / 4
    )
    x = torch.randn(256, 80, device="cuda", generator=g)
    pairs = [
        (
            torch.nn.Parameter(torch.randn(r, 80, device="cuda", generator=g) * 0.1),
            torch.nn.Parameter(torch.zeros(96, r, device="cuda")),
        )
        for r in (4, 4, 8)
    ]
    opt = PoLoRA(pairs, lr=2e-2, scale=2.0, scale_invariant=True, b_lr_ratio=b_lr_ratio)

    def loss() -> torch.Tensor:
        product = sum(2.0 * b @ a for a, b in pairs) / len(pairs)
        return ((x @ product.T - x @ target.T) ** 2).mean()

    first = loss().detach()
    for _ in range(200):
        opt.zero_grad()
        loss().backward()
        opt.step()
    torch.cuda.set_sync_debug_mode("default")
    assert loss().item() < first.item() / 100


def test_adamw_is_fused_on_cuda() -> None:
    model = torch.nn.Linear(8, 8).cuda()
    opt = build_optimizer(model, "adamw", lr=1e-3)
    assert opt.param_groups[0]["fused"] is True
