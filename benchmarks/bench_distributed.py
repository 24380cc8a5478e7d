"""Training steps under torchrun: tokens/s and peak memory per GPU, and scaling against one GPU.

Every process trains the same shape (bench_rows.py) with loralei's fused LoRA (and Liger with ``--liger``),
through the runner's engine (``loralei.train.launch``: the model and its loss as one module, in DDP for
``--distributed ddp``, its frozen base sharded by FSDP2 for ``fsdp2``), on its own random ids. Rank 0 gathers every rank's step time and peak allocated memory
and writes JSON + markdown.

    python benchmarks/bench_distributed.py --shape llama3-8b --liger --checkpointing --distributed none
    torchrun --nproc_per_node 1 benchmarks/bench_distributed.py --shape llama3-8b --liger --checkpointing \\
        --distributed ddp --baseline OUT/none.json
    torchrun --nproc_per_node 8 benchmarks/bench_distributed.py ... --distributed ddp --baseline OUT/none.json

``--baseline`` (the one-process run's JSON) adds the scaling efficiency: tokens/s per GPU against that run's.
``--summary A.json B.json ... --out T.md`` puts several runs in one table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import sync
from bench_rows import SHAPES, model_loss, prepared_model
from bench_train_step import adamw, batch_ids

from loralei.train import distributed, launch

# loralei's rows that shard under FSDP2: the bf16 base, and the NF4 base (TorchAO's NF4 shards by rows)
ROWS = ("loralei-fused", "loralei-nf4")


def step_seconds(engine, opt, ids: torch.Tensor, steps: int, device: torch.device) -> float:
    """Seconds per step (forward and backward through the engine, AdamW) on this rank; the ranks start
    together (a barrier before the clock starts; DDP's reductions keep them in step after)."""
    distributed.barrier()
    sync(device)
    start = time.perf_counter()
    reduce = getattr(engine, "reduce_gradients", None)  # FSDP2: the replicated LoRA factors (DDP: its hooks)
    for _ in range(steps):
        engine({"input_ids": ids}, ids, 1).backward()
        if reduce is not None:
            reduce()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    return (time.perf_counter() - start) / steps


def measure(args: argparse.Namespace) -> dict | None:
    run_launch = launch.read_launch(args.distributed)
    launch.FORWARD_PREFETCH = args.forward_prefetch
    device = launch.start(run_launch)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = prepared_model(args.shape, args.row, args.liger, args.checkpointing, device, dtype)
    engine = launch.wrap(
        model, lambda m, batch, labels, n: model_loss(m, batch["input_ids"]), run_launch, device
    )
    # seeded by rank: each rank trains on its own data
    opt, ids = adamw(model, device), batch_ids(args.shape, device, seed=1 + distributed.rank())
    step_seconds(engine, opt, ids, args.warmup, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = step_seconds(engine, opt, ids, args.steps, device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    ranks = distributed.gather_to_main({"seconds": seconds, "peak_gib": peak, "tokens": ids.numel()})
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    hook = engine._get_ddp_logging_data().get("comm_hook") if run_launch.mode == "ddp" else None
    launch.stop()
    if not ranks:
        return None
    per_gpu = [r["tokens"] / r["seconds"] for r in ranks]
    result = {
        "shape": args.shape,
        "row": args.row,
        "distributed": run_launch.mode,
        "backend": backend,
        "comm_hook": hook,
        "forward_prefetch": args.forward_prefetch if run_launch.mode == "fsdp2" else None,
        "processes": len(ranks),
        "liger": args.liger,
        "checkpointing": args.checkpointing,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens_per_s": sum(per_gpu),
        "tokens_per_s_per_gpu": sum(per_gpu) / len(per_gpu),
        "peak_gib_per_gpu": max(r["peak_gib"] or 0.0 for r in ranks) if device.type == "cuda" else None,
        "ranks": ranks,
    }
    if args.baseline is not None:
        base = json.loads(args.baseline.read_text())
        result["scaling_efficiency"] = result["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
    return result


HEAD = (
    "| shape | row | checkpointing | distributed | processes | tokens/s | tokens/s per GPU | peak GiB per GPU "
    "| scaling efficiency |\n|---|---|---|---|---|---|---|---|---|"
)


def table_line(result: dict) -> str:
    peak = f"{result['peak_gib_per_gpu']:.1f}" if result["peak_gib_per_gpu"] is not None else "n/a"
    efficiency = f"{result['scaling_efficiency']:.3f}" if "scaling_efficiency" in result else "n/a"
    mode = result["distributed"]
    # a depth other than the library's is named
    if result.get("forward_prefetch") not in (None, launch.FORWARD_PREFETCH):
        mode += f", forward prefetch {result['forward_prefetch']}"
    return (
        f"| {result['shape']} | {result.get('row', 'loralei-fused')} | {'on' if result['checkpointing'] else 'off'} | "
        f"{mode} | "
        f"{result['processes']} | {result['tokens_per_s']:,.0f} | {result['tokens_per_s_per_gpu']:,.0f} | {peak} | "
        f"{efficiency} |"
    )


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"{HEAD}\n{table_line(result)}\n")
    print(HEAD, table_line(result), sep="\n")


def summary(results: list[Path], out: Path) -> str:
    """One markdown table of several runs' JSON files (in the order given), written to ``out``."""
    text = "\n".join([HEAD, *(table_line(json.loads(path.read_text())) for path in results)]) + "\n"
    out.write_text(text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--distributed", default="auto", choices=["auto", "none", "ddp", "fsdp2"])
    parser.add_argument("--row", default="loralei-fused", choices=ROWS, help="the bf16 base or the NF4 base")
    parser.add_argument("--liger", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--warmup",
        type=int,
        default=11,
        help="untimed steps first; DDP times its first 10 iterations with CUDA events that it synchronises at the "
        "start of the next forward (forwards 2 to 11 wait for the GPU to drain), so timed steps start at the 12th",
    )
    parser.add_argument(
        "--forward-prefetch",
        type=int,
        default=launch.FORWARD_PREFETCH,
        help="fsdp2: how many following units' gathers each unit's forward starts (0: FSDP2's own order)",
    )
    parser.add_argument(
        "--baseline", type=Path, default=None, help="a one-process run's JSON (scaling efficiency)"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON file of the result (markdown beside it)"
    )
    parser.add_argument(
        "--summary",
        type=Path,
        nargs="+",
        default=None,
        help="measure nothing: write one markdown table of these runs' JSON files to --out",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.summary is not None:
        print(summary(args.summary, args.out), end="")
        return None
    result = measure(args)
    if result is not None:
        write(result, args.out)
    return result


if __name__ == "__main__":
    main()
