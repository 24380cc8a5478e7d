"""Op microbenchmarks of the train-step benchmark, and the timing helpers it shares with them.

For a dense shape's projections: loralei's fused ops (``lora_w``, ``lora_group``, ``lora_mlp``) against the
plain reference, forward + backward, milliseconds per call (MoE shapes have none). ``bench_train_step.py`` runs them after the steps
(skip with ``--no-ops``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch
from bench_rows import SHAPES, is_moe  # also puts the repository's src/ on sys.path

from loralei.ops import reference
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.lora_w import lora_w
from loralei.ops.shared_input import lora_group
from loralei.ops.weights import LoRAWeights


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gc_collections() -> list[int]:
    """Python's garbage collections so far in this process, per generation (the last, 2, is the full one: it
    walks every object, a few hundred ms with a model and its libraries loaded)."""
    return [generation["collections"] for generation in gc.get_stats()]


def ms_per_call(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Milliseconds per call of ``fn``, after ``warmup`` calls; waits for the device at both ends."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


def bench_op(fn: Callable[[], list[torch.Tensor]], reps: int, device: torch.device) -> float:
    """Milliseconds per forward + backward of ``fn``."""
    return ms_per_call(lambda: sum(o.float().sum() for o in fn()).backward(), device, 2, reps)


def micro(shape: str, args, device, dtype) -> list[dict]:
    """The fused-vs-plain op timings at a dense shape's projections; none for an MoE shape, whose layers have
    no dense gated MLP (its experts' products are in profile_experts.py)."""
    if is_moe(shape):
        return []
    _, cfg, batch_size, seq = SHAPES[shape]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = hidden * cfg["num_key_value_heads"] // cfg["num_attention_heads"]

    def proj(inp: int, out: int) -> LoRAWeights:
        a = (torch.randn(16, inp, device=device, dtype=dtype) / inp**0.5).requires_grad_()
        b = (torch.randn(out, 16, device=device, dtype=dtype) / 4).requires_grad_()
        return LoRAWeights(
            torch.randn(out, inp, device=device, dtype=dtype) / inp**0.5, None, a, b, 2.0, 0.0, None
        )

    x = torch.randn(batch_size, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    o, qkv, down = proj(hidden, hidden), [proj(hidden, n) for n in (hidden, kv, kv)], proj(inter, hidden)
    gate_up = [proj(hidden, inter) for _ in range(2)]
    xd = torch.randn(batch_size, seq, inter, device=device, dtype=dtype, requires_grad=True)
    cases = {
        "o_proj (lora_w)": (lambda: [lora_w(x, o)], lambda: [reference.lora_linear(x, o)]),
        "down_proj (lora_w)": (lambda: [lora_w(xd, down)], lambda: [reference.lora_linear(xd, down)]),
        "q/k/v (lora_group)": (lambda: list(lora_group(x, qkv)), lambda: list(reference.lora_group(x, qkv))),
        "gated MLP (lora_mlp)": (
            lambda: [lora_mlp(x, *gate_up, down, "silu")],
            lambda: [reference.lora_mlp(x, *gate_up, down, "silu")],
        ),
    }
    out = []
    for name, (fused, plain) in cases.items():
        f, p = bench_op(fused, args.op_reps, device), bench_op(plain, args.op_reps, device)
        out.append({"shape": shape, "op": name, "fused_ms": f, "plain_ms": p, "speedup": p / f})
    return out
