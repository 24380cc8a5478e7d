"""Sequence parallelism against one GPU: bench_runner.py results of one shape in one process and with each
sequence split over the GPUs (``--sequence-parallel``), in one markdown table.

    python benchmarks/sequence_parallel_table.py OUT/sp-1gpu-128k.json OUT/sp-2gpu-128k.json ... \\
        --out OUT/sequence-parallel.md

Each shape's one-process run is its baseline: the table gives every run's tokens/s and their ratio to the
baseline's (the step's speed-up), the peak allocated GiB of the run's largest rank, and the first and last losses
with their largest relative difference from the baseline's (the same rows, seed and initial adapter: the runs
differ only in the order of their sums). A shape without a one-process run gets no ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HEAD = (
    "| shape | GPUs | tokens/s | vs one GPU | peak GiB per GPU | first loss | last loss | loss vs one GPU |\n"
    "|---|---|---|---|---|---|---|---|"
)


def loss_difference(run: dict, base: dict) -> float:
    """The larger relative difference of the first and last losses from the baseline's."""
    return max(abs(run[key] - base[key]) / abs(base[key]) for key in ("first_loss", "last_loss"))


def table_line(run: dict, base: dict | None) -> str:
    peak = f"{run['peak_gib']:.2f}" if run["peak_gib"] is not None else "n/a"
    ratio = f"{run['tokens_per_s'] / base['tokens_per_s']:.2f}×" if base is not None else "n/a"
    loss = f"{loss_difference(run, base):.1e}" if base is not None and base is not run else ""
    return (
        f"| {run['shape']} | {run['processes']} | {run['tokens_per_s']:,.0f} | {ratio} | {peak} | "
        f"{run['first_loss']:.4f} | {run['last_loss']:.4f} | {loss} |"
    )


def table(runs: list[dict]) -> str:
    """The runs' lines, each shape's together in the order its runs were given, its baseline first."""
    shapes = list(dict.fromkeys(run["shape"] for run in runs))
    lines = [HEAD]
    for shape in shapes:
        mine = sorted((run for run in runs if run["shape"] == shape), key=lambda run: run["processes"])
        base = mine[0] if mine[0]["processes"] == 1 else None
        lines += [table_line(run, base) for run in mine]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+", help="bench_runner.py JSON files")
    parser.add_argument("--out", type=Path, required=True, help="the markdown table")
    args = parser.parse_args(argv)
    text = table([json.loads(path.read_text()) for path in args.runs])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
