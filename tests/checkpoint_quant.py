"""Synthetic pre-quantized tensors (GPTQ, AWQ, NVFP4) and each format's dequantization written element by element
from its definition, independently of loralei's unpacking: random codes, zero points and scales are packed the
way the format lays them out, so that reading them back is what is tested."""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the logical column held by 4-bit slot k of an AWQ word
E4M3 = torch.float8_e4m3fn


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """(..., 8) 4-bit values, slot k at bits 4k, as int32 words (two's complement)."""
    shifts = torch.arange(0, 32, 4)
    words = (nibbles.long() << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """(R, C) codes packed eight rows per word (GPTQ's qweight): word [r, c] holds rows 8r .. 8r+7."""
    rows, cols = codes.shape
    return _words(codes.reshape(rows // 8, 8, cols).transpose(1, 2))


def pack_cols(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """(R, C) codes packed eight columns per word; slot k of word [r, c] holds column 8c + order[k]."""
    rows, cols = codes.shape
    return _words(codes.reshape(rows, cols // 8, 8)[..., list(order)])


def act_order_groups(inp: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """A GPTQ act-order ``g_idx``: inputs quantized in a random order, each consecutive ``group_size`` of that
    order sharing a group."""
    order = torch.randperm(inp, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // group_size).to(torch.int32)
    return g_idx


def gptq_tensors(out: int, inp: int, group_size: int, act_order: bool = False, seed: int = 0) -> dict:
    """Random GPTQ tensors of an (out, in) linear: qweight, qzeros, scales (float16), g_idx."""
    g = torch.Generator().manual_seed(seed)
    groups = inp // group_size
    codes = torch.randint(0, 16, (inp, out), generator=g)
    zeros = torch.randint(0, 16, (groups, out), generator=g)
    g_idx = (
        act_order_groups(inp, group_size, seed)
        if act_order
        else torch.arange(inp, dtype=torch.int32) // group_size
    )
    return {
        "qweight": pack_rows(codes),
        "qzeros": pack_cols(zeros),
        "scales": (torch.rand(groups, out, generator=g) * 0.02 + 0.001).half(),
        "g_idx": g_idx.to(torch.int32),
    }


def awq_tensors(out: int, inp: int, group_size: int, seed: int = 0) -> dict:
    """Random AWQ (GEMM) tensors of an (out, in) linear: qweight, qzeros, scales (float16)."""
    g = torch.Generator().manual_seed(seed)
    groups = inp // group_size
    return {
        "qweight": pack_cols(torch.randint(0, 16, (inp, out), generator=g), AWQ_ORDER),
        "qzeros": pack_cols(torch.randint(0, 16, (groups, out), generator=g), AWQ_ORDER),
        "scales": (torch.rand(groups, out, generator=g) * 0.02 + 0.001).half(),
    }


def nvfp4_tensors(out: int, inp: int, seed: int = 0, lead: tuple[int, ...] = ()) -> dict:
    """Random ModelOpt NVFP4 tensors of an (out, in) linear (or ``lead`` of them, e.g. experts): weight, weight_scale,
    weight_scale_2, input_scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, out, inp), generator=g, dtype=torch.uint8)
    return {
        "weight": codes[..., 0::2] | (codes[..., 1::2] << 4),
        "weight_scale": (torch.rand(*lead, out, inp // 16, generator=g) * 4 + 0.05).to(E4M3),
        "weight_scale_2": torch.rand(lead, generator=g) * 0.01 + 0.001,
        "input_scale": torch.tensor(0.5) if not lead else torch.full(lead, 0.5),
    }


def _nibble(words: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    return (words.long() >> (4 * slot)) & 0xF


def gptq_reference(t: dict, zero_offset: int, dtype: torch.dtype) -> torch.Tensor:
    """``W[o, i] = (q[i, o] - (z[g_idx[i], o] + zero_offset)) · s[g_idx[i], o]``, each code read from its word."""
    inp, out = t["qweight"].shape[0] * 8, t["scales"].shape[1]
    i, o = torch.meshgrid(torch.arange(inp), torch.arange(out), indexing="ij")
    g = t["g_idx"].long()[i]
    q = _nibble(t["qweight"][i // 8, o], i % 8)
    z = _nibble(t["qzeros"][g, o // 8], o % 8) + zero_offset
    return ((q - z).float() * t["scales"][g, o].float()).to(dtype).t()


def awq_reference(t: dict, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``W[o, i] = (q[i, o] - z[i // group_size, o]) · s[i // group_size, o]``, column j of a word in slot
    ``AWQ_ORDER.index(j)``."""
    inp, out = t["qweight"].shape[0], t["scales"].shape[1]
    i, o = torch.meshgrid(torch.arange(inp), torch.arange(out), indexing="ij")
    slot = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])[o % 8]
    g = i // group_size
    q = _nibble(t["qweight"][i, o // 8], slot)
    z = _nibble(t["qzeros"][g, o // 8], slot)
    return ((q - z).float() * t["scales"][g, o].float()).to(dtype).t()


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """e2m1's value of each 4-bit code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is
    subnormal (``m · 0.5``)."""
    sign = 1 - 2 * ((code >> 3) & 1).float()
    exp, man = ((code >> 1) & 3).float(), (code & 1).float()
    normal = torch.pow(2.0, exp - 1) * (1 + man / 2)
    return sign * torch.where(exp == 0, man / 2, normal)


def nvfp4_reference(t: dict, dtype: torch.dtype) -> torch.Tensor:
    """``W[o, i] = e2m1(code[o, i]) · float(weight_scale[o, i // 16]) · weight_scale_2``, the code of input i in
    the low nibble of byte i // 2 when i is even."""
    out, inp = t["weight"].shape[0], t["weight"].shape[1] * 2
    o, i = torch.meshgrid(torch.arange(out), torch.arange(inp), indexing="ij")
    code = (t["weight"][o, i // 2].long() >> (4 * (i % 2))) & 0xF
    return (e2m1(code) * t["weight_scale"][o, i // 16].float() * t["weight_scale_2"].float()).to(dtype)
