"""loralei's RoPE kernel vs Transformers' formula (Triton interpreter, fp32 and fp16): outputs and gradients for
the attention's transposed layouts, several head blocks, odd half widths and shared or per-row cos/sin; which
families' ``apply_rotary_pos_emb`` it replaces (``loralei.fusion.rope``)."""

from __future__ import annotations

import importlib

import pytest
import torch

from loralei.fusion import rope as rope_fusion
from loralei.kernels import rope as kernels
from loralei.kernels.joint_buffer import joined, take_spare
from loralei.kernels.rope import apply_rope, rope_reference
from tolerances import assert_fp32_close, assert_low_precision_close

# (batch, q heads, k heads, seq, head dim, cos batch): GQA, more q heads than one block of 16, an odd half
# width (6, padded to 8), one cos/sin row shared by the batch
CASES = [(2, 4, 2, 5, 8, 2), (1, 3, 1, 7, 12, 1), (2, 20, 4, 3, 16, 1), (3, 2, 2, 4, 128, 3)]


def _inputs(case, dtype):
    batch, hq, hk, seq, dim, cos_batch = case
    gen = torch.Generator().manual_seed(sum(case))
    # as the attention makes them: (batch, seq, heads, d) viewed as (batch, heads, seq, d)
    q = torch.randn(batch, seq, hq, dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, hk, dim, generator=gen).to(dtype).transpose(1, 2)
    cos, sin = (torch.randn(cos_batch, seq, dim, generator=gen).to(dtype) for _ in range(2))
    dq, dk = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(k.shape, generator=gen).to(dtype)
    return q, k, cos, sin, dq, dk


def _run(fn, q, k, cos, sin, dq, dk) -> list[torch.Tensor]:
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = fn(q, k, cos, sin)
    return [qe.detach(), ke.detach(), *torch.autograd.grad((qe, ke), (q, k), (dq, dk))]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_torch_in_interpreter(interpret, case, dtype) -> None:
    q, k, cos, sin, dq, dk = _inputs(case, dtype)
    fused = _run(apply_rope, q, k, cos, sin, dq, dk)
    plain = _run(rope_reference, q, k, cos, sin, dq, dk)
    exact = _run(rope_reference, *(t.double() for t in (q, k, cos, sin, dq, dk)))
    assert fused[0].stride() == q.stride()  # the attention gets the layout it would have had
    for what, f, p, e in zip(["q", "k", "dq", "dk"], fused, plain, exact, strict=True):
        if dtype == torch.float32:
            assert_fp32_close(f, e, what)
        else:
            assert_low_precision_close(f, p, e, dtype, what)


def test_a_gradient_in_any_layout(interpret) -> None:
    """The backward takes gradients whose rows are not contiguous (the kernel reads rows of d elements)."""
    q, k, cos, sin, dq, dk = _inputs(CASES[0], torch.float32)
    dq_t = dq.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, d not the innermost dimension
    assert dq_t.stride(-1) != 1
    fused = _run(apply_rope, q, k, cos, sin, dq_t, dk)
    exact = _run(rope_reference, *(t.double() for t in (q, k, cos, sin, dq, dk)))
    assert_fp32_close(fused[2], exact[2], "dq")


def test_operands_the_kernel_does_not_take_go_to_torch(interpret) -> None:
    q, k, cos, sin, _, _ = _inputs(CASES[0], torch.float32)
    assert kernels.usable(q, k, cos, sin)
    half = cos[..., :4]  # partial rotary (Phi-3 style): the caller's formula, not this kernel's
    assert not kernels.usable(q, k, half, half)
    assert not kernels.usable(q, k, cos.requires_grad_(), sin)
    assert not kernels.usable(q.bfloat16(), k.bfloat16(), cos.detach().bfloat16(), sin.bfloat16())


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2", "gemma3", "phi3"])
def test_each_family_rope_is_recognised(family) -> None:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    fn = getattr(module, rope_fusion.NAME)
    original = fn.args[0] if rope_fusion.is_installed(fn) else fn  # an earlier test may have installed it
    assert rope_fusion.matches(original)


def test_another_formula_is_kept() -> None:
    def interleaved(q, k, cos, sin):  # GPT-J style pairs (x0, x1), (x2, x3)...: not the half-split formula
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin

    assert not rope_fusion.matches(interleaved)
    assert not rope_fusion.matches(lambda q, k, cos, sin, position_ids: (q, k))  # another signature


def test_the_replacement_calls_the_original_where_the_kernel_cannot_run() -> None:
    calls = []

    def original(q, k, cos, sin, *args):
        calls.append(args)
        return rope_reference(q, k, cos, sin)

    q, k, cos, sin, _, _ = _inputs(CASES[0], torch.float32)
    out = rope_fusion.fused_apply_rotary_pos_emb(original, q, k, cos, sin)  # the CPU, no interpreter
    out2 = rope_fusion.fused_apply_rotary_pos_emb(original, q, k, cos, sin, 2)  # an extra argument
    assert calls == [(), (2,)] and all(map(torch.equal, out, out2))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 16, 8, 512, 128, 2), (1, 40, 8, 256, 128, 1), (4, 8, 2, 128, 64, 4)])
def test_kernel_matches_torch_on_the_gpu(case) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, cos, sin, dq, dk = (t.cuda() for t in _inputs(case, torch.bfloat16))
    fused = _run(apply_rope, q, k, cos, sin, dq, dk)
    plain = _run(rope_reference, q, k, cos, sin, dq, dk)
    exact = _run(rope_reference, *(t.double() for t in (q, k, cos, sin, dq, dk)))
    for what, f, p, e in zip(["q", "k", "dq", "dk"], fused, plain, exact, strict=True):
        assert_low_precision_close(f, p, e, torch.bfloat16, what)


def test_backward_writes_dq_and_dk_side_by_side_with_room_for_dv(interpret) -> None:
    """q and k viewed from (batch, seq, heads · d) outputs: their gradients come back as adjacent column blocks
    of one buffer whose next k-wide block is spare (for the attention's v gradient), with the same values."""
    case = CASES[0]
    q, k, cos, sin, dq, dk = _inputs(case, torch.float32)
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qe, ke = apply_rope(q, k, cos, sin)
    gq, gk = torch.autograd.grad((qe, ke), (q, k), (dq, dk))
    exact = _run(rope_reference, *(t.double() for t in (q, k, cos, sin, dq, dk)))
    assert_fp32_close(gq, exact[2], "dq")
    assert_fp32_close(gk, exact[3], "dk")
    batch, hq, hk, seq, dim, _ = case
    flat_q, flat_k = gq.transpose(1, 2).reshape(-1, hq * dim), gk.transpose(1, 2).reshape(-1, hk * dim)
    assert joined(flat_q, flat_k, 1) is not None  # views of one buffer, no copy in the reshapes
    slot = take_spare(flat_k, torch.Size([batch * seq, hk * dim]))
    assert slot is not None and joined(flat_k, slot, 1) is not None
