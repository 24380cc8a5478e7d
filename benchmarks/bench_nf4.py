"""NF4 base products at the Llama-3-8B projection shapes: dequantize + cuBLAS vs the fused dequant-matmul (GPU).

For each (out, in) and direction (forward ``X Wᵀ``, input gradient ``dY W``) times, with
``triton.testing.do_bench`` (median), (a) the Triton dequantization into a bf16 buffer followed by ``torch.mm``
(also each part alone) and (b) :func:`loralei.kernels.nf4_matmul.nf4_matmul` (its tile searched, and cached,
before timing). Bytes per product: the weight side (dequant path: 0.5·out·in codes + scales read, 2·out·in
written, 2·out·in read again by cuBLAS; fused: the codes and scales once) and the activations (X and Y).

    python benchmarks/bench_nf4.py [--tokens 8192] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from loralei.kernels.nf4 import NF4Packed, dequantize
from loralei.kernels.nf4_matmul import nf4_matmul

SHAPES = {"q_o": (4096, 4096), "k_v": (1024, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}


def packed_weight(
    out_f: int, in_f: int, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16
) -> NF4Packed:
    """A random weight (bf16 on the GPU by default) quantized by TorchAO (block 64, scaler block 256) as loralei's
    packed layout."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:  # torchao < 0.15
        from torchao.dtypes.nf4tensor import to_nf4
    t = to_nf4(torch.randn(out_f, in_f, device=device, dtype=dtype), 64, 256)
    return NF4Packed(
        t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4,
        (out_f, in_f), t.block_size, t.scaler_block_size,
    )  # fmt: skip


def median_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call (do_bench flushes L2 between calls)."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def product_row(name: str, tokens: int, out_f: int, in_f: int, transpose: bool) -> dict:
    """The keys that name one product in a results row (the weight-product benchmarks share them)."""
    return {
        "proj": name,
        "direction": "dY W" if transpose else "X W^T",
        "T": tokens,
        "out": out_f,
        "in": in_f,
    }


def weight_bytes(p: NF4Packed) -> tuple[int, int]:
    """(dequant + cuBLAS, fused) bytes moved on the weight side of one product."""
    n = p.shape[0] * p.shape[1]
    packed = p.data.numel() + p.scalers.numel() + 2 * (p.factors.numel() + 1 + p.lut.numel())
    return packed + 2 * n + 2 * n, packed


def bench_case(name: str, p: NF4Packed, tokens: int, transpose: bool) -> dict:
    """Times both paths for one product; returns the table row."""
    out_f, in_f = p.shape
    k, n = (out_f, in_f) if transpose else (in_f, out_f)
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    dequantize(p, w)

    def gemm() -> torch.Tensor:
        return torch.mm(x, w if transpose else w.t())

    def dequant_gemm() -> torch.Tensor:
        dequantize(p, w)
        return gemm()

    nf4_matmul(x, p, transpose=transpose)  # the tile search (or the cache read) happens here, untimed
    times = {
        "dequant_ms": median_ms(lambda: dequantize(p, w)),
        "gemm_ms": median_ms(gemm),
        "dequant_gemm_ms": median_ms(dequant_gemm),
        "fused_ms": median_ms(lambda: nf4_matmul(x, p, transpose=transpose)),
    }
    flop = 2 * tokens * out_f * in_f
    dense_w, fused_w = weight_bytes(p)
    return {
        **product_row(name, tokens, out_f, in_f, transpose),
        **times,
        "dequant_gemm_tflops": flop / times["dequant_gemm_ms"] / 1e9,
        "fused_tflops": flop / times["fused_ms"] / 1e9,
        "weight_bytes_dequant_gemm": dense_w,
        "weight_bytes_fused": fused_w,
        "activation_bytes": 2 * tokens * (k + n),
    }


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'proj':8} {'product':7} {'out':>6} {'in':>6} {'deq ms':>7} {'mm ms':>7} {'deq+mm':>7} {'TF/s':>6} "
        f"{'fused':>7} {'TF/s':>6} {'W MB deq+mm':>11} {'W MB fused':>10} {'X+Y MB':>7}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['proj']:8} {r['direction']:7} {r['out']:6d} {r['in']:6d} {r['dequant_ms']:7.3f} "
            f"{r['gemm_ms']:7.3f} {r['dequant_gemm_ms']:7.3f} {r['dequant_gemm_tflops']:6.0f} "
            f"{r['fused_ms']:7.3f} {r['fused_tflops']:6.0f} {r['weight_bytes_dequant_gemm'] / 1e6:11.1f} "
            f"{r['weight_bytes_fused'] / 1e6:10.1f} {r['activation_bytes'] / 1e6:7.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="T, the rows of X (default 8192)")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        p = packed_weight(out_f, in_f)
        rows += [bench_case(name, p, args.tokens, transpose) for transpose in (False, True)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16")
    print_table(rows)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
