"""Base-GEMM throughput at a model's layer shapes: how fast the frozen-weight matmuls of a LoRA step run.

For each projection (T tokens, in -> out) times the forward ``X Wᵀ`` and the input gradient ``dY W``, each as a
fresh output (beta = 0, what PEFT's ``F.linear`` does) and accumulating into an existing output (beta = 1, what the
fused ops do after writing the LoRA term), plus q/k/v as one GEMM over concatenated weights. Prints TFLOP/s.

    python benchmarks/bench_gemm.py --shape llama3-8b [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from bench_train_step import SHAPES


def ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Mean milliseconds per call over ``iters`` calls after three warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    _, _, batch, seq = SHAPES[args.shape]
    tokens, dev, dt = batch * seq, "cuda", torch.bfloat16
    rows = []
    for name, (inp, out) in projections(args.shape).items():
        x, w = torch.randn(tokens, inp, device=dev, dtype=dt), torch.randn(out, inp, device=dev, dtype=dt)
        dy, y, dx = (torch.randn(tokens, n, device=dev, dtype=dt) for n in (out, out, inp))
        flop = 2 * tokens * inp * out
        cases = {
            "fwd X Wt (beta 0)": lambda x=x, w=w: torch.mm(x, w.t()),
            "fwd X Wt (beta 1)": lambda x=x, w=w, y=y: y.addmm_(x, w.t()),
            "fwd F.linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
            "dX dY W (beta 0)": lambda dy=dy, w=w: torch.mm(dy, w),
            "dX dY W (beta 1)": lambda dy=dy, w=w, dx=dx: dx.addmm_(dy, w),
        }
        for case, fn in cases.items():
            t = ms(fn)
            rows.append(
                {"proj": name, "in": inp, "out": out, "case": case, "ms": t, "tflops": flop / t / 1e9}
            )
            print(f"{name:18s} {inp:6d}->{out:6d}  {case:20s} {t:7.3f} ms  {flop / t / 1e9:6.0f} TFLOP/s")
    big = torch.randn(8192, 8192, device=dev, dtype=dt)
    t = ms(lambda: torch.mm(big, big))
    print(f"reference 8192^3 {t:.3f} ms {2 * 8192**3 / t / 1e9:.0f} TFLOP/s")
    rows.append({"proj": "8192^3", "case": "mm", "ms": t, "tflops": 2 * 8192**3 / t / 1e9})
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
