"""Optimizer step time on an 8B-sized set of LoRA factors: torch AdamW (fused, foreach) vs SkipStepAdamW vs PoLoRA.

The factors are those of Llama-3-8B with r=16 on q,k,v,o,gate,up,down: 32 layers × 7 projections × (A, B) =
448 tensors, fixed random gradients. Only ``optimizer.step()`` is timed (SkipStepAdamW gets the loss and the
pre-clip gradient norm as the training loop hands them over). Prints milliseconds per step.

    python benchmarks/bench_optimizers.py                  # CUDA when available, the real shapes
    python benchmarks/bench_optimizers.py --small          # quick CPU run: 448 tensors, shrunken widths
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_ops import ms_per_call  # also puts the repository's src/ on sys.path

from loralei.train.optim import PoLoRA, SkipStepAdamW

LAYERS, RANK = 32, 16
# (hidden, intermediate, kv width) of Llama-3-8B, and a shrunken set with the same tensor count for a CPU run.
DIMS = {"full": (4096, 14336, 1024), "small": (256, 896, 64)}

Pair = tuple[torch.Tensor, torch.Tensor]


def lora_pairs(small: bool, device: torch.device, dtype: torch.dtype) -> list[Pair]:
    """(A: r×in, B: out×r) for every projection of every layer, with random gradients attached."""
    hidden, inter, kv = DIMS["small" if small else "full"]
    projections = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]  # q, k, v, o: (in, out)
    projections += [(hidden, inter), (hidden, inter), (inter, hidden)]  # gate, up, down
    g = torch.Generator(device=device).manual_seed(0)
    pairs = []
    for _ in range(LAYERS):
        for fan_in, fan_out in projections:
            a = torch.randn(RANK, fan_in, device=device, dtype=dtype, generator=g) * fan_in**-0.5
            b = torch.randn(fan_out, RANK, device=device, dtype=dtype, generator=g) * 1e-3
            for t in (a, b):
                t.requires_grad_()
                t.grad = torch.randn(t.shape, device=device, dtype=dtype, generator=g) * 1e-3
            pairs.append((a, b))
    return pairs


def _flat(pairs: list[Pair]) -> list[torch.Tensor]:
    return [t for pair in pairs for t in pair]


def steppers(pairs: list[Pair]) -> dict[str, Callable[[], object]]:
    """One zero-argument step function per optimizer under test."""
    params = _flat(pairs)
    device = params[0].device
    loss = torch.full((), 2.0, device=device)
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    skipstep = SkipStepAdamW(params, lr=1e-5, weight_decay=0.0)
    out: dict[str, Callable[[], object]] = {}
    out["torch AdamW fused"] = torch.optim.AdamW(params, lr=1e-5, fused=True).step
    out["torch AdamW foreach"] = torch.optim.AdamW(params, lr=1e-5, foreach=True).step
    out["SkipStepAdamW"] = lambda: skipstep.step(loss=loss, grad_norm=grad_norm)
    out["PoLoRA (adamw)"] = PoLoRA(pairs, lr=1e-5, scale=2.0).step
    out["PoLoRA (sgd)"] = PoLoRA(pairs, lr=1e-5, scale=2.0, mode="sgd", momentum=0.9).step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--small", action="store_true", help="shrunken widths (same 448 tensors) for a CPU run"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    pairs = lora_pairs(args.small, device, dtype)
    count = sum(t.numel() for t in _flat(pairs))
    print(f"{len(pairs) * 2} tensors, {count / 1e6:.1f}M parameters, {args.dtype}, {device}")
    for name, step in steppers(pairs).items():
        print(f"{name:22s} {ms_per_call(step, device, args.warmup, args.iters):8.2f} ms/step")


if __name__ == "__main__":
    main()
