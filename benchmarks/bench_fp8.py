"""FP8 base products at the Llama-3-8B projection shapes: speed and accuracy against the bf16 GEMM.

For each (out, in) and direction (forward ``X Wᵀ``, input gradient ``dY W``), and for the joint input gradients
of the shared-input groups (``[dY_q dY_k dY_v] [W_q; W_k; W_v]``: K = 6144, and gate/up: K = 28672): the bf16
GEMM of the dense weight, loralei's FP8 product as the ops call it (:mod:`loralei.modules.quantized.fp8_gemm`:
the activation rounded to e4m3 per token, for ``dY W`` the scale fold and the transposed codes, then
``torch._scaled_mm``, the forward with fast accumulation as ``LoRAConfig.fp8_fast_accum`` defaults to), and the
bare ``torch._scaled_mm`` of operands quantized beforehand, with FP32 accumulation and with fast accumulation
(``use_fast_accum``); milliseconds (median) and TFLOP/s. Accuracy: the norm-wise relative error of the FP8 product
and of the bf16 product, both against the fp64 product of the original FP32 weight and inputs, the FP8 product's
against the bf16 one, and what fast accumulation alone costs: the bare fast product against the bare FP32 one.

A Triton FP8 GEMM of loralei's own was measured here against ``_scaled_mm`` (results file
``benchmarks/results/archive/2026-12-01-h200-fp8-gemm``: 1.3x to 1.8x its time, bit-identical output) and then
removed.

    python benchmarks/bench_fp8.py [--tokens 8192] [--out FILE.json]   # on an FP8 GPU
    python benchmarks/bench_fp8.py --shapes tiny --tokens 64 --device cpu  # the same code, small, on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nf4 import SHAPES as NF4_SHAPES
from bench_nf4 import product_row

from loralei.modules.quantized.fp8_gemm import fp8_grad_mm, fp8_mm, quantize_rows

SHAPES = {"llama3-8b": NF4_SHAPES, "tiny": {"square": (64, 64), "wide": (128, 64)}}
# The shared-input groups' joint input gradients: the out widths of the members, and their one in width.
JOINT = {
    "llama3-8b": {"qkv": ((4096, 1024, 1024), 4096), "gate_up": ((14336, 14336), 4096)},
    "tiny": {"pair": ((64, 32), 64)},
}
COLUMNS = ("bf16", "fp8", "bare", "bare_fast")


def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds per call over ``reps`` calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error of ``actual`` against ``expected``, in fp64."""
    expected = expected.double()
    return float((actual.double() - expected).norm() / expected.norm())


def bench_case(
    name: str, widths: tuple[int, ...], in_f: int, tokens: int, transpose: bool, args: argparse.Namespace
) -> dict:
    """One product, of a weight (Σwidths, in_f) stacked from members of those out widths (the joint input
    gradient; one member otherwise): its three timings and errors."""
    out_f = sum(widths)
    k = out_f if transpose else in_f
    g = torch.Generator().manual_seed(0)
    w32, a32 = torch.randn(out_f, in_f, generator=g) / in_f**0.5, torch.randn(tokens, k, generator=g)
    exact = a32.double() @ (w32.double() if transpose else w32.double().t())
    w, a = w32.to(args.device, torch.bfloat16), a32.to(args.device, torch.bfloat16)
    codes, scales = quantize_rows(w)
    if transpose:
        dys = [part.contiguous() for part in a.split(widths, 1)]  # the members' output gradients
        member_codes, member_scales = list(codes.split(widths)), list(scales.split(widths))
        fp8 = lambda: fp8_grad_mm(dys, member_codes, member_scales)  # noqa: E731
        dense = lambda: a @ w  # noqa: E731
        a8, sa = quantize_rows(a.float() * scales.t())
        b_t, sb = codes.t().contiguous().t(), torch.ones(1, in_f, device=args.device)
    else:
        fp8 = lambda: fp8_mm(a, codes, scales, fast_accum=True)  # noqa: E731
        dense = lambda: a @ w.t()  # noqa: E731
        a8, sa = quantize_rows(a)
        b_t, sb = codes.t(), scales.t()

    def bare(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(
            a8, b_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    fns = {"bf16": dense, "fp8": fp8, "bare": lambda: bare(False), "bare_fast": lambda: bare(True)}
    times = {key: median_ms(fn, args.device, args.reps) for key, fn in fns.items()}
    flop = 2 * tokens * out_f * in_f
    return {
        **product_row(name, tokens, out_f, in_f, transpose),
        **{f"{key}_ms": ms for key, ms in times.items()},
        **{f"{key}_tflops": flop / ms / 1e9 for key, ms in times.items()},
        "fp8_rel_err": rel_err(fp8().cpu(), exact),
        "bf16_rel_err": rel_err(dense().cpu(), exact),
        "fp8_vs_bf16_rel_err": rel_err(fp8().cpu(), dense().cpu().double()),
        "fast_vs_fp32_rel_err": rel_err(bare(True).cpu(), bare(False).cpu()),
    }


def cases(shapes: str) -> list[tuple[str, tuple[int, ...], int, bool]]:
    """(name, out widths, in width, transpose) of every product: both directions of each projection, then the
    joint input gradients."""
    single = [
        (name, (out_f,), in_f, t) for name, (out_f, in_f) in SHAPES[shapes].items() for t in (False, True)
    ]
    joint = [(name, widths, in_f, True) for name, (widths, in_f) in JOINT[shapes].items()]
    return single + joint


def print_table(rows: list[dict]) -> None:
    print(
        "| proj | product | K | bf16 ms (TF/s) | FP8 ms (TF/s) | bare _scaled_mm ms (TF/s) "
        "| bare, fast accumulation | FP8 rel. err | bf16 rel. err | FP8 vs bf16 | fast vs FP32 accumulation |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k + '_ms']:.3f} ({r[k + '_tflops']:.0f})" for k in COLUMNS]
        print(
            f"| {r['proj']} | {r['direction']} | {r['out'] if r['direction'] == 'dY W' else r['in']} "
            f"| {' | '.join(cells)} | {r['fp8_rel_err']:.2e} | {r['bf16_rel_err']:.2e} "
            f"| {r['fp8_vs_bf16_rel_err']:.2e} | {r['fast_vs_fp32_rel_err']:.2e} |"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=8192, help="T, the rows of X or dY (default 8192)")
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"))
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [
        bench_case(name, widths, in_f, args.tokens, transpose, args)
        for name, widths, in_f, transpose in cases(args.shapes)
    ]
    meta = {"device": str(args.device), "torch": torch.__version__}
    print(", ".join(f"{key} {value}" for key, value in meta.items()))
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
