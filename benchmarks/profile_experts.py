"""Where an MoE training step's time goes: routing, expert GEMMs (base, LoRA, bank gradients), activation, ...

Profiles ``--steps`` full training steps (after ``--warmup`` unprofiled ones) of any row of the train-step
benchmark (bench_rows.py) under ``torch.profiler`` with ``record_shapes``, and puts every unit of time into one
category of expert_categories.py's table. On CUDA a unit is a kernel, attributed through the profiler's event
tree to the op that launched it and that op's ancestors (a kernel no op claims keeps only its name). On CPU (the
reduced form, for the tiny-moe shape) a unit is an aten op's self CPU time. Writes a markdown table and JSON (ms
per step and per MoE layer, and each category's costliest kernels with the op and shapes that decided) under
``--out``.

    python benchmarks/profile_experts.py --shape qwen3-30b-a3b-8l --row loralei-fused --out results/experts
    python benchmarks/profile_experts.py --shape qwen3-30b-a3b-8l --row unsloth-bf16 --out results/experts
    python benchmarks/profile_experts.py --shape tiny-moe --row peft-bf16-adapters --out /tmp/experts   # CPU

Rows that run in a child in the benchmark (Unsloth) re-run this script in a child that imports their library
first, as the benchmark's children do; rows that load a checkpoint get the shape saved once (--checkpoint-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

# this folder's modules, also when a child runs this file through runpy (sys.path[0] is then not this folder)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import sync
from bench_rows import (
    FROM_CHECKPOINT,
    ISOLATED,
    ROWS,
    SHAPES,
    is_moe,
    moe_layers,
    prepared_model,
    row_loss,
    save_checkpoint,
)
from bench_train_step import CHILD_BOOT, CHILD_ENV, adamw, batch_ids, train_steps
from expert_categories import CATEGORIES, GEMM_OPS, GROUPED, Dims, Unit, classify
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def _ancestry(ev) -> list:
    chain = []
    while ev is not None:
        chain.append(ev)
        ev = ev.cpu_parent
    return chain


def _tensor_shapes(ev) -> tuple[tuple[int, ...], ...]:
    """The op's inputs that are tensors of 2 or more dimensions (not offsets, scalars or tensor lists)."""
    shapes = ev.input_shapes or ()
    return tuple(tuple(s) for s in shapes if len(s) >= 2 and all(isinstance(n, int) for n in s))


def _unit(name: str, us: float, ev) -> Unit:
    chain = _ancestry(ev)
    gemms = [e for e in chain if GEMM_OPS.match(e.name) or GROUPED.search(e.name)]
    top = gemms[-1] if gemms else None
    return Unit(
        name=name,
        us=us,
        op=ev.name,
        shapes=_tensor_shapes(ev),
        gemm=top.name if top else "",
        gemm_shapes=_tensor_shapes(top) if top else (),
        ancestors=tuple(e.name for e in chain),
    )


def units(events, cuda: bool) -> list[Unit]:
    """The profile's units of time. CUDA: every kernel, through the op that launched it (``ev.kernels``); kernels
    that no op claims come back by name only. GPU-side copies of CPU ranges (user annotations such as
    ``Optimizer.step``, which span other kernels) are left out. CPU: every aten op's self time."""
    if not cuda:
        return [_unit(ev.name, ev.self_cpu_time_total, ev) for ev in events if ev.name.startswith("aten::")]
    ranges = {ev.name for ev in events if ev.device_type == DeviceType.CPU}
    out, claimed = [], Counter()
    for ev in events:
        if ev.device_type == DeviceType.CPU:
            for k in ev.kernels:
                if k.name not in ranges:
                    out.append(_unit(k.name, k.duration, ev))
                    claimed[k.name] += k.duration
    every = Counter()
    for ev in events:
        if ev.device_type == DeviceType.CUDA and ev.name not in ranges:
            every[ev.name] += ev.time_range.elapsed_us()
    out += [Unit(name, us - claimed[name]) for name, us in every.items() if us - claimed[name] > 0.5]
    return out


def summarise(all_units: list[Unit], dims: Dims, steps: int, layers: int) -> dict:
    """Per category: ms per step, ms per step and MoE layer, share; and its costliest kernels (or ops) with the
    op and the shapes that classified them, to check the table against a real profile."""
    by_cat: dict[str, Counter] = {label: Counter() for label, _ in CATEGORIES}
    for u in all_units:
        by_cat[classify(u, dims)][u.name[:140], u.gemm or u.op, str(list(u.gemm_shapes or u.shapes))] += u.us
    total = sum(sum(c.values()) for c in by_cat.values())
    rows = []
    for label, found in by_cat.items():
        us = sum(found.values())
        top = [
            {"kernel": k, "op": op, "shapes": sh, "ms_per_step": t / 1e3 / steps}
            for (k, op, sh), t in found.most_common(8)
        ]
        rows.append(
            {
                "category": label,
                "ms_per_step": us / 1e3 / steps,
                "ms_per_moe_layer": us / 1e3 / steps / layers,
                "share": us / total if total else 0.0,
                "top": top,
            }
        )
    return {"total_ms_per_step": total / 1e3 / steps, "categories": rows}


def write(result: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    head = f"{result['shape']} {result['row']}" + (" +liger" if result["liger"] else "")
    lines = [
        f"# Expert time split: {head}, checkpointing {result['checkpointing']}",
        "",
        f"{result['unit']}; {result['steps']} profiled steps, {result['moe_layers']} MoE layers; "
        f"{result['total_ms_per_step']:.2f} ms/step in all, {result['wall_ms_per_step']:.1f} ms/step wall "
        f"(under the profiler); unprofiled, one step took {result['step_ms']:.1f} ms, issued by the host in "
        f"{result['issue_ms']:.1f} ms.",
        "",
        "| category | ms / step | ms / step / MoE layer | share |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {c['category']} | {c['ms_per_step']:.3f} | {c['ms_per_moe_layer']:.3f} | {100 * c['share']:.1f} % |"
        for c in result["categories"]
        if c["ms_per_step"] > 0
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def profile_row(args, device: torch.device, dtype: torch.dtype) -> dict:
    model = prepared_model(
        args.shape, args.row, args.liger, args.checkpointing, device, dtype, args.checkpoint_dir
    )
    ids, opt = batch_ids(args.shape, device), adamw(model, device)
    loss = row_loss(args.row)
    train_steps(model, opt, ids, args.warmup, loss)
    sync(device)
    # one unprofiled step: how long the host takes to issue it against how long it takes to finish (a host-bound
    # step has the two close together: the GPU waits for the host)
    start = time.perf_counter()
    train_steps(model, opt, ids, 1, loss)
    issued = time.perf_counter()
    sync(device)
    host = {"issue_ms": (issued - start) * 1e3, "step_ms": (time.perf_counter() - start) * 1e3}
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        train_steps(model, opt, ids, args.steps, loss)
        sync(device)
        wall = (time.perf_counter() - start) / args.steps
    layers = moe_layers(args.shape)
    result = {
        "shape": args.shape,
        "row": args.row,
        "liger": args.liger,
        "checkpointing": args.checkpointing,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "unit": "CUDA kernel time" if cuda else "CPU self time of aten ops",
        "steps": args.steps,
        "moe_layers": layers,
        "wall_ms_per_step": wall * 1e3,
        **host,
    }
    return result | summarise(units(prof.events(), cuda), Dims.of(args.shape), args.steps, layers)


def run_in_child(args, argv: list[str]) -> int:
    """This script again, in a process that imports the row's library first (Unsloth patches Transformers and
    PEFT when imported), through the benchmark's child boot and environment."""
    env = os.environ | CHILD_ENV | {"LORALEI_BENCH_PREIMPORT": ISOLATED[args.row]}
    cmd = [sys.executable, "-c", CHILD_BOOT, str(Path(__file__).resolve()), *argv]
    return subprocess.run(cmd, env=env, check=False).returncode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b-8l", choices=sorted(filter(is_moe, SHAPES)))
    parser.add_argument("--row", default="loralei-fused", choices=ROWS)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps (1 for the expert-loop rows)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--liger", action="store_true")
    parser.add_argument(
        "--cpu", action="store_true", help="profile on CPU (fp32) even where CUDA is available"
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="saved model of the shape for the rows that load one (saved there first when missing)",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the markdown and JSON results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    with tempfile.TemporaryDirectory(prefix="profile-ckpt-") as scratch:
        if args.row in FROM_CHECKPOINT and args.checkpoint_dir is None:
            args.checkpoint_dir = Path(scratch)
            argv = [*argv, "--checkpoint-dir", scratch]
        # as in the benchmark: tokenizer.json is written last, so a save cut short is redone
        if args.row in FROM_CHECKPOINT and not (args.checkpoint_dir / "tokenizer.json").exists():
            save_checkpoint(args.shape, args.checkpoint_dir, device, dtype)
        if args.row in ISOLATED and os.environ.get("LORALEI_BENCH_PREIMPORT") != ISOLATED[args.row]:
            code = run_in_child(args, argv)
            if code:
                raise SystemExit(f"{args.row}: the profiling child exited with code {code}")
            return None
        result = profile_row(args, device, dtype)
    stem = (
        f"experts-{args.shape}-{args.row}" + ("-liger" if args.liger else "") + "-ckpt" * args.checkpointing
    )
    write(result, args.out, stem)
    return result


if __name__ == "__main__":
    main()
