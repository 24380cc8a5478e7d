"""The one table of numeric tolerances for tests, and the helpers that apply it.

Errors are norm-wise relative: ``‖actual - expected‖ / ‖expected‖``. Low-precision results are judged against
an fp64 reference: the fused error may be at most ``LOW_PRECISION_FACTOR`` times the plain-torch error of the
same dtype vs that reference, and never needs to beat ``LOW_PRECISION_FLOOR`` (half an ulp at 1.0: a result
rounded once to the dtype can be that far off even where plain torch happens to be exact, e.g. on 1 element).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FP32_REL = 1e-5
# An FP32 model's loss and LoRA gradients against its FP64 twin (the same weights, nothing rounded): through every
# layer's GEMMs, norms, softmax and RoPE both ways, FP32 rounding compounds to about 1e-5 on either path (2-layer
# Llama, Qwen3 and Gemma 2 with NF4 and FP8 bases, on an AVX2 CPU: plain up to 8.3e-6, fused up to 9.9e-6, in
# directions of their own). A wrong layout, scale or missing term is off by 1e-3 or more.
# An ill-conditioned result can round further on another CPU: see fp32_rounding_spread below.
FP32_MODEL_REL = 3e-5
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Rounding to float8_e4m3fn (3 mantissa bits): at most half an ulp, 2^-4 of the value where it is normal
# (|x| >= 2^-6), and 2^-10 (half the subnormal spacing 2^-9) below.
E4M3_REL, E4M3_SUBNORMAL_ABS = 2.0**-4, 2.0**-10

# Where a result is ill-conditioned, a fixed FP32 bound fits neither every input nor every CPU: the FP32 error is
# about κ·u (u = 2^-24 the unit roundoff, κ how much the result amplifies rounding on the way), and the rounding's
# direction depends on the kernels' summation orders (vector width, blocking), so on the CPU. fp32_rounding_spread
# estimates κ·u on the CPU-independent FP64 computation by random rounding (Monte Carlo arithmetic): every op's
# result, forward and backward, times (1 + δ), δ uniform in [-u, u], the rms error over FP32_ROUNDING_SAMPLES runs.
# Calibration: the preference objectives' LoRA gradients on the 2-layer Llama (ORPO on 40 seeds, the five DPO
# cases on 8, each at 3 pairs unpacked, 4 and 5 packed: 240 cases), on an AVX-512 + AMX Xeon and again with its
# AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2). Spreads 1.2e-6 to
# 1.9e-4; loralei's errors at most 4.3 spreads (medians 0.8 to 1.3), the plain FP32 definition's at most 5.4
# (medians 0.85 to 1.3), alike on both kernel sets. One rounding per result understates a long sum's;
# FP32_ROUNDING_FACTOR covers that and the tail, with room.
FP32_ROUNDING_FACTOR = 10.0
FP32_ROUNDING_SAMPLES = 8
# a bound above this cannot tell a wrong formula, layout or missing term (off by 1e-3 or more) from rounding
FP32_MEANINGFUL_BOUND = 5e-4


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error of ``actual`` against ``expected``, computed in fp64."""
    expected = expected.detach().double()
    diff = (actual.detach().double() - expected).norm()
    scale = expected.norm()
    return float(diff / scale) if scale > 0 else float(diff)


def assert_fp32_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str = "", tolerance: float = FP32_REL
) -> None:
    """Fails when the relative error exceeds ``tolerance`` (``FP32_REL`` unless given)."""
    err = rel_err(actual, expected)
    assert err <= tolerance, f"{what}: relative error {err:.3e} > {tolerance:g}"


def assert_low_precision_close(
    fused: torch.Tensor, plain: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, what: str = ""
) -> None:
    """Fails when ``fused`` is further from the fp64 ``reference`` than the table allows (see module doc)."""
    fused_err, plain_err = rel_err(fused, reference), rel_err(plain, reference)
    bound = max(LOW_PRECISION_FACTOR * plain_err, LOW_PRECISION_FLOOR[dtype])
    assert fused_err <= bound, f"{what}: error {fused_err:.3e} > bound {bound:.3e} (plain {plain_err:.3e})"


# ops that move, place or negate values without rounding them
_EXACT_OPS = frozenset(
    {
        "_to_copy", "_unsafe_view", "cat", "clone", "constant_pad_nd", "copy_", "detach", "embedding", "empty",
        "empty_like", "expand", "fill_", "full", "full_like", "gather", "index", "index_put", "index_put_",
        "index_select", "lift_fresh", "masked_fill", "masked_fill_", "masked_select", "neg", "new_empty",
        "new_ones", "new_zeros", "nonzero", "ones", "ones_like", "repeat", "scalar_tensor", "scatter",
        "select_backward", "slice_backward", "stack", "tril", "triu", "where", "zero_", "zeros", "zeros_like",
    }
)  # fmt: skip


class _RandomRounding(TorchDispatchMode):
    """Multiplies every FP64 result that rounds by ``1 + δ``, ``δ`` uniform in ``[-u, u]`` (u = 2^-24)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket.__name__ in _EXACT_OPS:
            return out
        for result in out if isinstance(out, tuple | list) else (out,):
            if isinstance(result, torch.Tensor) and result.dtype == torch.float64 and result.numel():
                u = 2.0**-24
                noise = torch.rand(result.shape, dtype=torch.float64, generator=self.generator)
                result.mul_(noise.mul_(2 * u).add_(1 - u))
        return out


def fp32_rounding_spread(
    compute: Callable[[], torch.Tensor], exact: torch.Tensor, samples: int = FP32_ROUNDING_SAMPLES
) -> float:
    """How far FP32 rounding moves a result: the rms relative error against ``exact`` of ``compute()``, an FP64
    computation (CPU tensors; autograd's backward included when ``compute`` runs it), with every op's result
    randomly rounded at FP32's unit roundoff (see ``FP32_ROUNDING_FACTOR``). Seeded: the same on every CPU."""
    errors = []
    for seed in range(samples):
        with _RandomRounding(seed):
            result = compute()
        errors.append(rel_err(result, exact))
    return (sum(e * e for e in errors) / samples) ** 0.5


def assert_fp32_rounding_close(
    actual: torch.Tensor, exact: torch.Tensor, compute: Callable[[], torch.Tensor], what: str = ""
) -> None:
    """Fails when an FP32 result is further from the FP64 ``exact`` one than ``FP32_ROUNDING_FACTOR`` times the
    rounding spread of ``compute`` (:func:`fp32_rounding_spread`; never under ``FP32_MODEL_REL``), or when that
    bound is too loose to catch a wrong formula (``FP32_MEANINGFUL_BOUND``: an input too ill-conditioned to test)."""
    spread = fp32_rounding_spread(compute, exact)
    bound = max(FP32_MODEL_REL, FP32_ROUNDING_FACTOR * spread)
    assert bound <= FP32_MEANINGFUL_BOUND, f"{what}: rounding spread {spread:.3e} too large to test against"
    err = rel_err(actual, exact)
    assert err <= bound, (
        f"{what}: relative error {err:.3e} > {bound:.3e} ({FP32_ROUNDING_FACTOR:g} x spread {spread:.3e})"
    )
