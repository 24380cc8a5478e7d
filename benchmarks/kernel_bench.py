"""What the kernel benchmarks that run on a GPU or, at tiny shapes, in Triton's interpreter share: their
arguments, the timer and the JSON file of their rows."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch


def parse_args(description: str, shapes: Iterable[str], argv: list[str] | None) -> argparse.Namespace:
    """``--shapes`` (one of ``shapes``, llama3-8b by default), ``--device`` (cuda) and ``--out`` (a JSON file)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", choices=sorted(shapes), default="llama3-8b")
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"))
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    return parser.parse_args(argv)


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds per call: ``triton.testing.do_bench`` on a GPU, three timed calls elsewhere."""
    if device.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def write_rows(out: Path | None, device: torch.device, rows: list[dict]) -> None:
    """Writes ``{"device": ..., "rows": rows}`` to ``out`` when given."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        out.write_text(json.dumps({"device": name, "rows": rows}, indent=1) + "\n")
