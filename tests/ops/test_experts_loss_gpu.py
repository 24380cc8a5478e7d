"""GPU (bf16) numerics of the fused experts op (grouped GEMMs, Triton gather / combine / activation) and of the
chunked linear cross entropy (Triton row kernel): fused error vs fp64 <= 2x the plain bf16 error.

Run on a CUDA machine with ``pytest -m gpu tests/ops/test_experts_loss_gpu.py``; CPU CI deselects these.
"""

from __future__ import annotations

import pytest
import torch

from loralei.ops import reference
from loralei.ops.linear_cross_entropy import linear_cross_entropy
from loralei.ops.lora_experts import lora_experts
from loralei.ops.weights import ExpertBank
from tolerances import assert_low_precision_close

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BF16 = torch.bfloat16


def _bank(e: int, inp: int, out: int, r: int, g: torch.Generator, dtype: torch.dtype) -> ExpertBank:
    w = (torch.randn(e, out, inp, generator=g) / inp**0.5).to(CUDA, dtype)
    a = (torch.randn(e, r, inp, generator=g) / inp**0.5).to(CUDA).requires_grad_()
    b = (torch.randn(e, out, r, generator=g) / r**0.5).to(CUDA).requires_grad_()
    return ExpertBank(w, None, a, b, 0.5, None, False)


def _as(bank: ExpertBank, dtype: torch.dtype) -> ExpertBank:
    return bank._replace(
        W=bank.W.to(dtype),
        A=bank.A.detach().to(dtype).requires_grad_(),
        B=bank.B.detach().to(dtype).requires_grad_(),
    )


def _gate(gate_up: torch.Tensor) -> torch.Tensor:
    return reference.gated_activation(*gate_up.chunk(2, dim=-1), "silu")


def _experts_run(op, x, index, weights, up, down, *extra):
    x, weights = x.detach().requires_grad_(), weights.detach().requires_grad_()
    out = op(x, index, weights, up, down, *extra)
    dy = torch.randn(out.shape, generator=torch.Generator(CUDA).manual_seed(3), device=CUDA, dtype=out.dtype)
    grads = torch.autograd.grad(out, [x, weights, up.A, up.B, down.A, down.B], dy)
    return [out, *grads]


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k", "r"),
    [(256, 64, 48, 8, 2, 8), (512, 128, 96, 16, 4, 16)],
)
def test_fused_experts_bf16(tokens, hidden, inter, experts, top_k, r) -> None:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(CUDA)
    scores = torch.randn(tokens, experts, generator=g).to(CUDA)
    scores[:, -1] = -1e9  # an idle expert
    weights, index = scores.softmax(-1).topk(top_k, dim=-1)
    up = _bank(experts, hidden, 2 * inter, r, g, BF16)
    down = _bank(experts, inter, hidden, r, g, BF16)
    exact = _experts_run(
        reference.lora_experts,
        x.double(),
        index,
        weights.double(),
        _as(up, torch.float64),
        _as(down, torch.float64),
        _gate,
    )
    plain = _experts_run(
        reference.lora_experts, x.to(BF16), index, weights.to(BF16), _as(up, BF16), _as(down, BF16), _gate
    )
    fused = _experts_run(
        lora_experts, x.to(BF16), index, weights.to(BF16), _as(up, BF16), _as(down, BF16), "silu"
    )
    for i, (f, p, e) in enumerate(zip(fused, plain, exact, strict=True)):
        assert_low_precision_close(f, p, e, BF16, what=f"experts output/grad {i}")


@pytest.mark.parametrize(("rows", "hidden", "vocab"), [(300, 64, 5000), (1024, 128, 32003)])
def test_linear_cross_entropy_bf16(rows: int, hidden: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, hidden, generator=g).to(CUDA)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(CUDA)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(CUDA)
    targets[::5] = -100

    def run(fn, dtype, **kw):
        leaf = x.to(dtype).requires_grad_()
        loss = fn(leaf, w.to(dtype), targets, **kw)
        (grad,) = torch.autograd.grad(loss, leaf)
        return [loss, grad]

    exact = run(reference.linear_cross_entropy, torch.float64)
    plain = run(reference.linear_cross_entropy, BF16)
    fused = run(linear_cross_entropy, BF16, chunk_bytes=128 * vocab * 2)  # several chunks
    for i, (f, p, e) in enumerate(zip(fused, plain, exact, strict=True)):
        assert_low_precision_close(f, p, e, BF16, what=f"loss/grad {i}")
