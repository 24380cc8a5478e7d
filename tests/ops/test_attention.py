"""loralei.ops.attention: causal attention through the kernel SDPA picks, called directly, its forward kept and
its backward run later on the kept output, equals ``scaled_dot_product_attention`` with autograd: output and
every gradient bit for bit on the CPU (the flash kernel), with and without grouped-query heads; the cuDNN / flash
kernels on CUDA to their run-to-run variation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loralei.ops import attention


def operands(heads: int, kv_heads: int, tokens: int, dim: int, device: str = "cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(heads * 100 + tokens)

    def one(h: int) -> torch.Tensor:  # (B, H, T, D) as Transformers passes it: a transposed (B, T, H, D)
        x = torch.randn(2, tokens, h, dim, generator=g).to(device, dtype).transpose(1, 2)
        return x.detach().requires_grad_()

    return one(heads), one(kv_heads), one(kv_heads)


def through_kept(q, k, v, scale):
    kernel = attention.kernel_for(q, k, v, scale)
    assert kernel is not None
    kept = attention.attend(kernel, q.detach(), k.detach(), v.detach(), scale)
    after = []
    out = attention.replayed(q, k, v, kept, scale, lambda: after.append(1))
    return out, after


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tokens", "dim"), [(4, 4, 12, 8), (4, 2, 33, 16), (8, 1, 70, 32)]
)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_kept_attention_equals_sdpa_bit_for_bit_on_the_cpu(heads, kv_heads, tokens, dim, scale):
    q, k, v = operands(heads, kv_heads, tokens, dim)
    grad = torch.randn(2, heads, tokens, dim, generator=torch.Generator().manual_seed(5))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got, after = through_kept(q, k, v, scale)
    assert after == []  # nothing runs before the backward
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert after == [1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("kv_heads", "groups"), [(1, 1), (2, 2), (3, 3), (6, 3), (8, 4), (32, 4)])
def test_the_backward_runs_in_groups_of_heads_that_divide_the_key_value_heads(kv_heads, groups):
    assert attention.head_groups(kv_heads) == groups


def test_kernels_that_would_pad_or_are_not_fused_are_left_to_sdpa():
    q, k, v = operands(4, 2, 12, 12)  # 12 dims: the fused kernels pad them
    assert attention.kernel_for(q, k, v, None) is None
    q, k, v = operands(4, 4, 12, 8)
    assert attention.kernel_for(q, k[:, :, :6], v[:, :, :6], None) is None  # fewer keys than queries


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [256, 4096])
def test_kept_attention_equals_sdpa_on_cuda(tokens):
    q, k, v = operands(32, 8, tokens, 128, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(q)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got, _ = through_kept(q, k, v, None)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the query gradient of cuDNN's backward sums with atomics: it varies in the last bits from run to run
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-3, msg=name)
