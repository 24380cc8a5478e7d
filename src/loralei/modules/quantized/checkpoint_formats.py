"""The pre-quantized checkpoint formats loralei reads itself, as data: what a checkpoint's config says
(:class:`QuantSpec`), which tensors hold each quantized linear, their shapes and dtypes, and how they are
dequantized: the formula in plain torch (:mod:`.unpack`) and the Triton kernel that writes the same values into a
buffer (:mod:`loralei.kernels.checkpoint_dequant`).

The formats (facts of the layouts, as the tools that write them define them):

- GPTQ (``quant_method: "gptq"``; AutoGPTQ, GPTQModel, optimum): ``qweight`` int32 (in/8, out), eight 4-bit
  codes per word along the inputs, low bits first; ``qzeros`` int32 (groups, out/8), likewise along the outputs;
  ``scales`` (groups, out); ``g_idx`` int32 (in,), the group of each input (required with act-order,
  ``desc_act: true``; else ``i // group_size``). ``checkpoint_format`` (or ``format``) ``"gptq"`` (v1) stores
  each zero point minus one, ``"gptq_v2"`` stores it as it is. ``group_size: -1`` is one group per output.
- AWQ (``quant_method: "awq"``, ``version: "gemm"``): ``qweight`` int32 (in, out/8) and ``qzeros`` int32
  (groups, out/8), packed along the outputs in the interleaved order 0 2 4 6 1 3 5 7; ``scales`` (groups, out);
  groups of ``group_size`` consecutive inputs; zero points stored as they are.
- NVFP4 (NVIDIA ModelOpt, ``quant_method: "modelopt"``, ``quant_algo: "NVFP4"``, ``group_size: 16``):
  ``weight`` uint8 (out, in/2), two e2m1 codes per byte, low nibble first; ``weight_scale`` float8_e4m3fn
  (out, in/16); ``weight_scale_2`` float32, one global scale; ``input_scale`` float32, the activations' scale
  for FP4 GEMMs, unused when activations stay in 16 bits. An MoE checkpoint stores each expert's projections
  so (``<experts>.<e>.gate_proj.weight``, ...); loralei stacks them into banks (:mod:`.checkpoint_bank`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from ...kernels import checkpoint_dequant as kernels
from . import unpack

GPTQ_ORDER = tuple(range(unpack.CODES_PER_WORD))
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the logical position of the code in each 4-bit slot of a word
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QuantSpec(NamedTuple):
    """What a checkpoint's quantization config says, checked (hashable: it is part of a packed weight's
    identity).

    Attributes:
        method: ``"gptq"``, ``"awq"`` or ``"nvfp4"`` (a key of :data:`FORMATS`).
        group_size: inputs per scale (GPTQ/AWQ; -1: one group of all inputs), 16 for NVFP4.
        act_order: GPTQ's ``desc_act``: groups follow ``g_idx``, which the checkpoint must hold.
        zero_offset: added to each stored zero point (1 for GPTQ's v1 format).
    """

    method: str
    group_size: int
    act_order: bool = False
    zero_offset: int = 0


class Dims(NamedTuple):
    """A quantized linear's dense shape and its number of groups."""

    out: int
    inp: int
    groups: int


class Part(NamedTuple):
    """One tensor of a quantized linear: its name suffix, its shape from the dims, the dtypes it may have, whether
    a checkpoint must hold it, and whether the weight keeps it (NVFP4's activation scale serves FP4 GEMMs only)."""

    name: str
    shape: Callable[[Dims], tuple[int, ...]]
    dtypes: tuple[torch.dtype, ...]
    required: bool = True
    kept: bool = True


class Format(NamedTuple):
    """One checkpoint format: its name in messages, its tensors (the first marks a quantized linear), how many
    codes a packed element holds along (out, in), its dequantization in torch (the tensors by part name, the
    spec, the dtype) and through the kernel into a 2-D (out, in) buffer (the tensors, the spec, the buffer;
    where :func:`loralei.kernels.checkpoint_dequant.usable` says the kernels run), and, for a format whose
    expert banks loralei reads, the kernel writing chosen experts of a bank into an (E, out, in) buffer in one
    launch (the bank's tensors, the spec, the buffer, the experts)."""

    title: str
    parts: tuple[Part, ...]
    packing: tuple[int, int]
    dequantize: Callable[[Mapping[str, Tensor], QuantSpec, torch.dtype], Tensor]
    write: Callable[[Mapping[str, Tensor], QuantSpec, Tensor], Tensor]
    write_experts: Callable[[Mapping[str, Tensor], QuantSpec, Tensor, list[int] | None], Tensor] | None = None

    @property
    def marker(self) -> str:
        """The tensor whose presence makes a linear quantized."""
        return self.parts[0].name


def _int4(
    order: tuple[int, ...], weight_dim: int
) -> Callable[[Mapping[str, Tensor], QuantSpec, torch.dtype], Tensor]:
    """The dequantization of an integer format whose ``qweight`` is packed along ``weight_dim``."""

    def dequantize(t: Mapping[str, Tensor], spec: QuantSpec, dtype: torch.dtype) -> Tensor:
        codes = unpack.unpack_words(t["qweight"], weight_dim, order)
        zeros = unpack.unpack_words(t["qzeros"], 1, order)
        stored = t.get("g_idx")
        group = group_index(spec, codes.shape[0], codes.device) if stored is None else stored.long()
        return unpack.int4_groups(codes, zeros, t["scales"], group, spec.zero_offset, dtype)

    return dequantize


def _int4_write(
    order: tuple[int, ...], weight_dim: int
) -> Callable[[Mapping[str, Tensor], QuantSpec, Tensor], Tensor]:
    """The kernel dequantization of an integer format whose ``qweight`` is packed along ``weight_dim``."""

    def write(t: Mapping[str, Tensor], spec: QuantSpec, out: Tensor) -> Tensor:
        words = kernels.IntWords(
            t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), group_width(spec, out.shape[1]),
            spec.zero_offset, order, weight_dim,
        )  # fmt: skip
        return kernels.dequantize_int_words(words, out)

    return write


def _nvfp4_codes(t: Mapping[str, Tensor]) -> kernels.FloatCodes:
    """An NVFP4 weight's (or expert bank's) tensors as the e2m1 kernel reads them."""
    return kernels.FloatCodes(t["weight"], t["weight_scale"], t["weight_scale_2"])


def _nvfp4_write(t: Mapping[str, Tensor], spec: QuantSpec, out: Tensor) -> Tensor:
    """The kernel dequantization of an NVFP4 weight."""
    return kernels.dequantize_float_codes(_nvfp4_codes(t), out)


def _nvfp4_write_experts(
    t: Mapping[str, Tensor], spec: QuantSpec, out: Tensor, experts: list[int] | None
) -> Tensor:
    """The kernel dequantization of chosen experts of an NVFP4 bank (``None``: all)."""
    return kernels.dequantize_float_bank(_nvfp4_codes(t), out, experts)


_WORD = unpack.CODES_PER_WORD
_QZEROS = Part("qzeros", lambda d: (d.groups, d.out // _WORD), (torch.int32,))
_SCALES = Part("scales", lambda d: (d.groups, d.out), SCALE_DTYPES)

FORMATS: dict[str, Format] = {
    "gptq": Format(
        "GPTQ",
        (
            Part("qweight", lambda d: (d.inp // _WORD, d.out), (torch.int32,)),
            _QZEROS,
            _SCALES,
            Part("g_idx", lambda d: (d.inp,), (torch.int32, torch.int64), required=False),
        ),
        (_WORD, _WORD),
        _int4(GPTQ_ORDER, 0),
        _int4_write(GPTQ_ORDER, 0),
    ),
    "awq": Format(
        "AWQ",
        (Part("qweight", lambda d: (d.inp, d.out // _WORD), (torch.int32,)), _QZEROS, _SCALES),
        (_WORD, 1),
        _int4(AWQ_ORDER, 1),
        _int4_write(AWQ_ORDER, 1),
    ),
    "nvfp4": Format(
        "NVFP4",
        (
            Part("weight_scale", lambda d: (d.out, d.groups), (torch.float8_e4m3fn,)),
            Part("weight", lambda d: (d.out, d.inp // 2), (torch.uint8,)),
            Part("weight_scale_2", lambda d: (), (torch.float32,)),
            Part("input_scale", lambda d: (), (torch.float32,), required=False, kept=False),
        ),
        (1, unpack.CODES_PER_BYTE),
        lambda t, s, dtype: unpack.nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], dtype),
        _nvfp4_write,
        _nvfp4_write_experts,
    ),
}


def groups_of(spec: QuantSpec, inp: int) -> int:
    """How many scale groups a linear of ``inp`` inputs has."""
    return 1 if spec.group_size == -1 else inp // spec.group_size


def group_width(spec: QuantSpec, inp: int) -> int:
    """Inputs per group of a linear of ``inp`` inputs."""
    return inp if spec.group_size == -1 else spec.group_size


def group_index(spec: QuantSpec, inp: int, device: torch.device) -> Tensor:
    """The group of each input (int64 (inp,)) when the groups are consecutive runs of inputs: AWQ's, and GPTQ's
    without act-order when the checkpoint holds no ``g_idx``."""
    return torch.arange(inp, device=device) // group_width(spec, inp)
