"""One MoE layer's experts with LoRA: the fused grouped op's time, split into its parts, vs the plain twin.

Random banks and factors of a real shape (default: Qwen3-30B-A3B — 128 experts, top-8, hidden 2048, expert
intermediate 768 — at 4×2048 tokens, r=16, bf16), random routing. Times forward+backward of
``ops.lora_experts.lora_experts`` and, for the split, each of its parts run alone on the same tensors:
routing/sort, gathers and the per-token sum, base grouped GEMMs, LoRA-factor GEMMs, the gated activation.

    python benchmarks/bench_experts.py --out benchmarks/results/experts-split.json     # on a GPU
    python benchmarks/bench_experts.py --tiny                                           # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from bench_ops import ms_per_call  # also puts the repository's src/ on sys.path

from loralei.kernels.moe import act_backward_, act_forward
from loralei.ops import reference
from loralei.ops.grouped import grouped_mm, grouped_weight_grad, sort_routes
from loralei.ops.lora_experts import lora_experts
from loralei.ops.weights import ExpertBank

SHAPES = {
    "qwen3-30b-a3b": {"tokens": 8192, "hidden": 2048, "inter": 768, "experts": 128, "top_k": 8, "r": 16},
    "tiny": {"tokens": 64, "hidden": 32, "inter": 16, "experts": 8, "top_k": 2, "r": 4},
}


def layer(shape: dict, device: torch.device, dtype: torch.dtype, factor_dtype: torch.dtype) -> dict:
    """Random inputs, routing and banks of one layer (seeded)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    t, h, i, e, k, r = (shape[n] for n in ("tokens", "hidden", "inter", "experts", "top_k", "r"))

    def rand(*size: int, std: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * std).to(device=device, dtype=dt)

    logits = rand(t, e, dt=torch.float32)
    weights, index = torch.softmax(logits, -1).topk(k, dim=-1)
    banks = {
        "up": ExpertBank(
            rand(e, 2 * i, h, std=h**-0.5),
            None,
            rand(e, r, h, std=h**-0.5, dt=factor_dtype),
            rand(e, 2 * i, r, std=0.1, dt=factor_dtype),
            2.0,
            None,
            False,
        ),
        "down": ExpertBank(
            rand(e, h, i, std=i**-0.5),
            None,
            rand(e, r, i, std=i**-0.5, dt=factor_dtype),
            rand(e, h, r, std=0.1, dt=factor_dtype),
            2.0,
            None,
            False,
        ),
    }
    for bank in banks.values():
        bank.A.requires_grad_()
        bank.B.requires_grad_()
    return {
        "x": rand(t, h).requires_grad_(),
        "index": index,
        "weights": (weights / weights.sum(-1, keepdim=True)).to(dtype).requires_grad_(),
        **banks,
    }


def fwd_bwd(op: Callable[..., torch.Tensor], L: dict, *extra) -> Callable[[], None]:
    def run() -> None:
        out = op(L["x"], L["index"], L["weights"], L["up"], L["down"], *extra)
        out.backward(torch.ones_like(out))

    return run


def split(L: dict, reps: int, device: torch.device) -> dict[str, float]:
    """Milliseconds of each part of the fused op's forward + backward, run alone on the layer's tensors."""
    up, down = L["up"], L["down"]
    e = up.W.shape[0]
    routing = sort_routes(L["index"], e)
    x = L["x"].detach()
    xs = routing.gather(x)
    s_rows, i2 = xs.shape[0], up.W.shape[1]
    g = torch.randn(s_rows, i2, device=x.device, dtype=x.dtype)
    h = act_forward(g, "silu")
    w_s = routing.sorted_weights(L["weights"].detach())
    dy_s = torch.randn_like(xs)
    z = torch.randn(s_rows, up.A.shape[1], device=x.device, dtype=x.dtype)
    a_u, b_u = up.A.detach().to(x.dtype), up.B.detach().to(x.dtype)
    a_d, b_d = down.A.detach().to(x.dtype), down.B.detach().to(x.dtype)

    def base() -> None:  # 2 forward products, 2 input-gradient products
        grouped_mm(xs, up.W.transpose(-2, -1), routing)
        grouped_mm(h, down.W.transpose(-2, -1), routing)
        grouped_mm(dy_s, down.W, routing)
        grouped_mm(g, up.W, routing)

    def lora() -> None:  # per bank: Z, Z·Bᵀ, P, P·A forward/input-grad products and both factor gradients
        for inp, dout, a, b in ((xs, g, a_u, b_u), (h, dy_s, a_d, b_d)):
            zz = grouped_mm(inp, a.transpose(-2, -1), routing)
            grouped_mm(zz, b.transpose(-2, -1), routing)
            p = grouped_mm(dout, b, routing)
            grouped_mm(p, a, routing)
            grouped_weight_grad(p.t(), inp, routing, a.dtype)
            grouped_weight_grad(dout.t(), z, routing, b.dtype)

    g2, h2, g_lora = g.clone(), h.clone(), g.clone()

    def activation() -> None:  # forward; backward (with h recomputed and the routing weights' gradient), each
        # summing its input's base and LoRA addends as the op does
        act_forward(g, "silu", g_lora)
        act_backward_(h2, g2, w_s, "silu", h)

    def gathers() -> (
        None
    ):  # x gathered twice, dY once; the forward's and backward's per-token sums of two addends
        routing.gather(x)
        routing.gather(x)
        routing.gather(dy_s[: x.shape[0]])
        routing.combine(dy_s, L["weights"].detach(), dy_s)
        routing.combine(dy_s, None, dy_s)

    parts = {
        "routing/sort": lambda: sort_routes(L["index"], e),
        "base grouped GEMMs": base,
        "LoRA terms": lora,
        "activation": activation,
        "gathers + per-token sums": gathers,
    }
    return {name: ms_per_call(fn, device, 2, reps) for name, fn in parts.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--fp32-factors", action="store_true", help="FP32 LoRA factors (lora_fp32_gradients)")
    parser.add_argument("--no-plain", action="store_true", help="skip the (slow) expert-by-expert twin")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape, args.reps = "tiny", 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    L = layer(SHAPES[args.shape], device, dtype, torch.float32 if args.fp32_factors else dtype)
    gate = lambda gu: reference.gated_activation(*gu.chunk(2, dim=-1), "silu")  # noqa: E731
    result = {
        "shape": args.shape,
        **SHAPES[args.shape],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "fused_ms": ms_per_call(fwd_bwd(lora_experts, L, "silu"), device, 2, args.reps),
        "split_ms": split(L, args.reps, device),
    }
    if not args.no_plain:
        result["plain_ms"] = ms_per_call(
            fwd_bwd(reference.lora_experts, L, gate), device, 2, max(1, args.reps // 5)
        )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd(lora_experts, L, "silu")()
        result["fused_peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
