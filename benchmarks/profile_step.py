"""Where a training step's GPU time goes: one profiled step of the benchmark's loralei-fused row, by category.

    python benchmarks/profile_step.py --shape llama3-8b [--liger] [--checkpointing] [--out FILE.json]

Categories come from kernel names (GEMM, attention, Triton activation, Liger, optimizer, elementwise/other);
matmuls with a dimension equal to the LoRA rank are reported as "LoRA GEMMs" (from op-level input shapes); see
profile_summary.py, which bench_runner.py's ``--profile`` shares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_rows import SHAPES, prepared_model
from bench_train_step import adamw, batch_ids, train_steps
from profile_summary import print_summary, summarize
from torch.profiler import ProfilerActivity, profile


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
    result = {"shape": args.shape, "row": args.row, "liger": args.liger, "checkpointing": args.checkpointing}
    result |= summarize(prof)
    print_summary(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
