"""Base-GEMM throughput at a model's layer shapes: how fast the frozen-weight matmuls of a LoRA step run.

For each projection (T tokens, in -> out) times the forward ``X Wᵀ`` and the input gradient ``dY W``, each into a
fresh output (beta = 0; PEFT's ``F.linear``) and accumulating into an existing one (beta = 1, what the fused ops do
after writing the LoRA term), plus q/k/v as one GEMM over concatenated weights. The cases of one projection run
interleaved, in rounds, and each reports its median over the rounds: GPU clocks drift under sustained load, so
timing one case after another biases whichever runs later.

    python benchmarks/bench_gemm.py --shape llama3-8b [--rounds 12] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from bench_rows import SHAPES, is_moe


def ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Mean milliseconds per call over ``iters`` back-to-back calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def projections(shape: str) -> dict[str, tuple[int, int]]:
    cfg = SHAPES[shape][1]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {
        "q": (hidden, q),
        "k/v": (hidden, kv),
        "o": (q, hidden),
        "gate/up": (hidden, inter),
        "down": (inter, hidden),
        "qkv concatenated": (hidden, q + 2 * kv),
    }


def cases(tokens: int, inp: int, out: int) -> dict[str, Callable[[], object]]:
    dev, dt = "cuda", torch.bfloat16
    x, w = torch.randn(tokens, inp, device=dev, dtype=dt), torch.randn(out, inp, device=dev, dtype=dt)
    dy, y, y0 = (torch.randn(tokens, out, device=dev, dtype=dt) for _ in range(3))
    dx, dx0 = (torch.randn(tokens, inp, device=dev, dtype=dt) for _ in range(2))
    return {
        "fwd X Wt (beta 0)": lambda: torch.mm(x, w.t(), out=y0),
        "fwd X Wt (beta 1)": lambda: y.addmm_(x, w.t()),
        "fwd F.linear": lambda: torch.nn.functional.linear(x, w),
        "dX dY W (beta 0)": lambda: torch.mm(dy, w, out=dx0),
        "dX dY W (beta 1)": lambda: dx.addmm_(dy, w),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(s for s in SHAPES if not is_moe(s)))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    _, _, batch, seq = SHAPES[args.shape]
    tokens = batch * seq
    rows = []
    for name, (inp, out) in projections(args.shape).items():
        fns = cases(tokens, inp, out)
        for fn in fns.values():
            ms(fn, 3)
        times: dict[str, list[float]] = {case: [] for case in fns}
        for _ in range(args.rounds):
            for case, fn in fns.items():
                times[case].append(ms(fn))
        flop = 2 * tokens * inp * out
        for case, values in times.items():
            t = statistics.median(values)
            rows.append(
                {"proj": name, "in": inp, "out": out, "case": case, "ms": t, "tflops": flop / t / 1e9}
            )
            print(f"{name:18s} {inp:6d}->{out:6d}  {case:20s} {t:7.3f} ms  {flop / t / 1e9:6.0f} TFLOP/s")
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = statistics.median(ms(lambda: torch.mm(big, big)) for _ in range(args.rounds))
    print(f"reference 8192^3 {t:.3f} ms {2 * 8192**3 / t / 1e9:.0f} TFLOP/s")
    rows.append({"proj": "8192^3", "case": "mm", "ms": t, "tflops": 2 * 8192**3 / t / 1e9})
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
