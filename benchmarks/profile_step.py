"""Where a training step's GPU time goes: one profiled step of the benchmark's loralei-fused row, by category.

    python benchmarks/profile_step.py --shape llama3-8b [--liger] [--checkpointing] [--out FILE.json]

Categories come from kernel names (GEMM, attention, Triton activation, Liger, optimizer, elementwise/other);
matmuls with a dimension equal to the LoRA rank are reported as "LoRA GEMMs" (from op-level input shapes).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from bench_rows import SHAPES, prepared_model
from bench_train_step import adamw, batch_ids, train_steps
from torch.profiler import ProfilerActivity, profile

RANK = 16
CATEGORIES = [  # first match wins
    ("attention", r"flash|fmha|attention|sdpa"),
    ("liger (norm/rope/loss)", r"liger|_rms_norm|_rope|_cross_entropy|element_mul"),
    ("loralei triton (gated act, MLP backward)", r"gated_act|_gated"),
    ("optimizer", r"multi_tensor|fused_adam|adamw"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|sm90|matmul"),
    (
        "elementwise / reduce / copy",
        r"elementwise|vectorized|reduce|copy|fill|cat|index|softmax|norm|pow|mul|add",
    ),
]


def categorise(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def lora_gemm_ms(prof) -> float:
    total = 0.0
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key in ("aten::mm", "aten::addmm", "aten::bmm") and any(
            RANK in shape for shape in ev.input_shapes if shape
        ):
            total += ev.self_device_time_total / 1e3
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--row", default="loralei-fused")
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = prepared_model(args.shape, args.row, args.liger, args.checkpointing, device, torch.bfloat16)
    ids, opt = batch_ids(args.shape, device), adamw(model, device)
    train_steps(model, opt, ids, 2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        train_steps(model, opt, ids, 1)
        torch.cuda.synchronize()
    by_cat: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_cat[categorise(ev.key)] = by_cat.get(categorise(ev.key), 0.0) + ev.self_device_time_total / 1e3
    total = sum(by_cat.values())
    result = {"shape": args.shape, "row": args.row, "liger": args.liger, "checkpointing": args.checkpointing,
              "total_ms": total, "categories_ms": by_cat, "lora_gemm_ms": lora_gemm_ms(prof)}  # fmt: skip
    print(
        f"{args.shape} {args.row}{' +liger' if args.liger else ''} ckpt={args.checkpointing}: {total:.1f} ms"
    )
    for label, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {label:30s} {ms:8.1f} ms  {100 * ms / total:5.1f} %")
    print(f"  (of GEMM: LoRA-rank matmuls {result['lora_gemm_ms']:.1f} ms)")
    top = sorted(
        (ev for ev in prof.key_averages() if ev.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda ev: -ev.self_device_time_total,
    )[:25]
    result["top_kernels"] = [(ev.key[:120], ev.self_device_time_total / 1e3, ev.count) for ev in top]
    for name, ms, count in result["top_kernels"]:
        print(f"    {ms:8.2f} ms  x{count:<5d} {name[:100]}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
