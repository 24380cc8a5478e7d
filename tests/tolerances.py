"""The one table of numeric tolerances for tests, and the helpers that apply it.

Errors are norm-wise relative: ``‖actual - expected‖ / ‖expected‖``. Low-precision results are judged against
an fp64 reference: the fused error may be at most ``LOW_PRECISION_FACTOR`` times the plain-torch error of the
same dtype vs that reference, and never needs to beat ``LOW_PRECISION_FLOOR`` (half an ulp at 1.0: a result
rounded once to the dtype can be that far off even where plain torch happens to be exact, e.g. on 1 element).
"""

from __future__ import annotations

import torch

FP32_REL = 1e-5
# An FP32 model's loss and LoRA gradients against its FP64 twin (the same weights, nothing rounded): through every
# layer's GEMMs, norms, softmax and RoPE both ways, FP32 rounding compounds to about 1e-5 on either path (2-layer
# Llama, Qwen3 and Gemma 2 with NF4 and FP8 bases, on an AVX2 CPU: plain up to 8.3e-6, fused up to 9.9e-6, in
# directions of their own). A wrong layout, scale or missing term is off by 1e-3 or more.
FP32_MODEL_REL = 3e-5
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_FLOOR = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# Rounding to float8_e4m3fn (3 mantissa bits): at most half an ulp, 2^-4 of the value where it is normal
# (|x| >= 2^-6), and 2^-10 (half the subnormal spacing 2^-9) below.
E4M3_REL, E4M3_SUBNORMAL_ABS = 2.0**-4, 2.0**-10


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
