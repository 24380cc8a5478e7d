"""The grouped GEMMs of one MoE layer's NVFP4 banks: the kernel reading the codes against dequantizing the routed
experts into a buffer and ``torch._grouped_mm`` (and against the bf16 banks' grouped GEMM alone).

Random bf16 banks of a real shape (default: Qwen3-30B-A3B, 128 experts, top-8, hidden 2048, expert
intermediate 768, 4×2048 tokens) quantized to NVFP4 as bench_experts.py does, random routing; the four base
products of the fused experts op (gate_up and down forward, their input gradients), each timed alone, for each
of the kernel's row tiles and global-scale placements.

    python benchmarks/bench_nvfp4_grouped.py --out OUT/nvfp4-grouped.json     # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_nvfp4_grouped.py --tiny         # CPU smoke run (fp32)
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from bench_experts import SHAPES, layer, nvfp4_bank
from bench_ops import ms_per_call

from loralei.kernels import nvfp4_grouped
from loralei.kernels.checkpoint_dequant import FloatCodes
from loralei.ops.grouped import Routing, grouped_mm, sort_routes
from loralei.ops.weights import ExpertBank

# (row tile, global scale on the output, W the left operand)
VARIANTS = [(128, False, False), (128, True, False), (128, True, True), (256, True, False), (256, True, True)]


def products(L: dict) -> tuple[Routing, list[tuple[str, str, bool, torch.Tensor]]]:
    """The layer's routing and (name, bank, input gradient, rows) of the four base products."""
    x = L["x"].detach()
    routing = sort_routes(L["index"], L["up"].W.shape[0])
    s, i2, h = routing.token.shape[0], L["up"].W.shape[1], x.shape[1]

    def rows(n: int) -> torch.Tensor:
        return torch.randn(s, n, device=x.device, dtype=x.dtype)

    return routing, [
        ("gate_up forward", "up", False, routing.gather(x)),
        ("down forward", "down", False, rows(i2 // 2)),
        ("down input grad", "down", True, rows(h)),
        ("gate_up input grad", "up", True, rows(i2)),
    ]


def timed(
    dense: ExpertBank, quant: ExpertBank, x: torch.Tensor, input_grad: bool, routing: Routing, reps: int
) -> dict:
    """Milliseconds of one product: the bf16 bank's grouped GEMM, dequantize + grouped GEMM, each kernel variant."""
    device, bank = x.device, quant.quant
    w = dense.W if input_grad else dense.W.transpose(-2, -1)
    parts = bank.tensor.parts
    codes = FloatCodes(parts["weight"], parts["weight_scale"], parts["weight_scale_2"])
    buffer = torch.empty_like(dense.W)
    experts = list(range(dense.W.shape[0]))

    def buffered() -> None:
        d = bank.dequantize(experts, buffer)
        grouped_mm(x, d if input_grad else d.transpose(-2, -1), routing)

    row = {
        "dense_grouped_mm_ms": ms_per_call(lambda: grouped_mm(x, w, routing), device, 3, reps),
        "dequantize_then_grouped_mm_ms": ms_per_call(buffered, device, 3, reps),
    }
    for block_m, scale_output, w_left in VARIANTS:
        key = f"kernel_m{block_m}{'_scaled_output' if scale_output else ''}{'_w_left' if w_left else ''}_ms"
        row[key] = ms_per_call(
            functools.partial(
                nvfp4_grouped.grouped_mm, x, codes, routing.offsets, input_grad, block_m, scale_output, w_left
            ),
            device, 3, reps,
        )  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run (the kernel under TRITON_INTERPRET=1)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape, args.reps = "tiny", 1
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    L = layer(SHAPES[args.shape], device, dtype, dtype)
    banks = {"up": nvfp4_bank(L["up"], 2), "down": nvfp4_bank(L["down"], 1)}
    routing, rows = products(L)
    result = {
        "shape": args.shape,
        **SHAPES[args.shape],
        "device": "cpu" if args.tiny else torch.cuda.get_device_name(),
        "products": [],
    }
    for name, bank, input_grad, x in rows:
        row = {"product": name, **timed(L[bank], banks[bank], x, input_grad, routing, args.reps)}
        result["products"].append(row)
        print(json.dumps(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
