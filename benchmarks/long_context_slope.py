"""Issue 45's memory slope from one long-context call (``bash benchmarks/run_gpu.sh OUT long-context``): for the
runner (offloaded checkpointing) and Unsloth (its offloaded checkpointing), the training step's peak at each
length, the least-squares line through them (device bytes per token, and the fixed cost at zero tokens), the
context that line reaches on a GPU of a given size, and the runner's pinned host bytes per token at each length
(with what its offloading kept there: past the host budget it keeps less, so no line is fitted to them).

    python benchmarks/long_context_slope.py OUT --out OUT/long-context.md

Reads ``OUT/long-runner-LEN.json`` (bench_runner.py) and ``OUT/long-unsloth-LEN.json`` (bench_train_step.py) for
every LEN present, and ``OUT/long-runner-step.json`` (the one long step) when it exists, with
``OUT/long-runner-step-untiled.json`` (the same sequence, its MLPs untiled): the tiled step's loss against it.
With ``OUT/long-memory-LEN.json`` at two lengths or more (``memory_step.py --snapshot``), the runner's slope split by
what is alive at the step's peak, site by site.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rows import LONG_LENGTHS

GIB = 2**30
H200_BYTES = 141e9  # the GPU the bar names


class Line(NamedTuple):
    """``bytes(tokens) = fixed + per_token * tokens``, fitted by least squares."""

    per_token: float
    fixed: float

    def tokens_within(self, capacity: float) -> float:
        """Tokens at which the line reaches ``capacity`` bytes."""
        return (capacity - self.fixed) / self.per_token


def fit(points: list[tuple[int, float]]) -> Line:
    """The least-squares line through (tokens, bytes) points (two or more, at different lengths)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return Line(slope, mean_y - slope * mean_x)


def _runner(out: Path, name: str) -> dict | None:
    path = out / f"long-runner-{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _unsloth(out: Path, name: str) -> dict | None:
    path = out / f"long-unsloth-{name}.json"
    if not path.exists():
        return None
    steps = json.loads(path.read_text())["steps"]
    return steps[0] if steps else None


def measurements(out: Path) -> dict[str, list[tuple[int, dict]]]:
    """Every length's runner and Unsloth rows found under ``out``, by peer, shortest first."""
    found: dict[str, list[tuple[int, dict]]] = {"runner": [], "unsloth": []}
    for name, tokens in LONG_LENGTHS.items():
        for peer, read in (("runner", _runner), ("unsloth", _unsloth)):
            if (row := read(out, name)) is not None:
                found[peer].append((tokens, row))
    return found


def report(out: Path, capacity: float = H200_BYTES) -> str:
    """The call's table, the fitted lines and what they extrapolate to, as Markdown."""
    found = measurements(out)
    lines = [
        "| tokens | runner tok/s | runner step peak GiB | runner host GiB | Unsloth tok/s | Unsloth step peak GiB |"
    ]
    lines.append("|---|---|---|---|---|---|")
    by_length: dict[int, dict[str, dict]] = {}
    for peer, rows in found.items():
        for tokens, row in rows:
            by_length.setdefault(tokens, {})[peer] = row
    for tokens in sorted(by_length):
        r, u = by_length[tokens].get("runner"), by_length[tokens].get("unsloth")
        cells = [
            f"{r['tokens_per_s']:,.0f}" if r else "n/a",
            f"{r['peak_gib']:.2f}" if r else "n/a",
            f"{r.get('offload_host_gib', float('nan')):.2f}" if r else "n/a",
            f"{u['tokens_per_s']:,.0f}" if u else "n/a",
            f"{u['peak_gib']:.2f}" if u else "n/a",
        ]
        lines.append(f"| {tokens:,} | " + " | ".join(cells) + " |")
    lines.append("")
    fitted = {}
    for peer, rows in found.items():
        if len({t for t, _ in rows}) < 2:
            lines.append(f"{peer}: fewer than two lengths, no slope")
            continue
        line = fit([(t, row["peak_gib"] * GIB) for t, row in rows])
        fitted[peer] = line
        lines.append(
            f"{peer}: {line.per_token / 1024:.2f} KiB of device memory per token, {line.fixed / GIB:.2f} GiB fixed; "
            f"reaches {capacity / 1e9:.0f} GB at {line.tokens_within(capacity):,.0f} tokens"
        )
    lines += host_lines(found["runner"])
    if len(fitted) == 2:
        ratio = fitted["runner"].per_token / fitted["unsloth"].per_token
        reach = fitted["runner"].tokens_within(capacity) / fitted["unsloth"].tokens_within(capacity)
        lines.append(f"runner / Unsloth: slope {ratio:.3f}, extrapolated context {reach:.2f}x")
    lines += long_step_lines(out)
    lines += site_lines(out)
    return "\n".join(lines) + "\n"


def host_lines(rows: list[tuple[int, dict]]) -> list[str]:
    """The runner's pinned host memory a token at each length, with what its offloading kept there. No line is
    fitted: past the host budget (half the machine's memory) the runner keeps less, so the bytes stop growing."""
    lines = []
    for tokens, row in rows:
        if "offload_host_gib" not in row:
            continue
        kept = [
            note.split(": ", 1)[1]
            for note in row.get("notes", [])
            if note.startswith("offloaded checkpointing:")
        ]
        per_token = row["offload_host_gib"] * GIB / tokens / 1024
        lines.append(
            f"runner at {tokens:,} tokens: {per_token:,.0f} KiB of pinned host memory a token"
            + (f" ({kept[0]})" if kept else "")
        )
    return lines


def _alive_at_peak(out: Path) -> list[tuple[int, dict]]:
    """The runner's step memory rows (``long-memory-LEN.json``, ``memory_step.py --snapshot``) that recorded what is
    alive at the step's peak, by length, shortest first."""
    found = []
    for name, tokens in LONG_LENGTHS.items():
        path = out / f"long-memory-{name}.json"
        if path.exists() and "alive_at_peak" in (row := json.loads(path.read_text())):
            found.append((tokens, row["alive_at_peak"]))
    return found


def site_lines(out: Path, top: int = 12) -> list[str]:
    """The slope split by what is alive at the step's peak: each allocation site's bytes there at the shortest and
    the longest length with a memory row, and their difference per token (largest first), with the total of
    what the step allocated; nothing without two such rows."""
    rows = _alive_at_peak(out)
    if len(rows) < 2:
        return []
    (short, low), (long, high) = rows[0], rows[-1]
    sites = {entry["where"]: [0, 0] for entry in low["by_site"] + high["by_site"]}
    for column, row in enumerate((low, high)):
        for entry in row["by_site"]:
            sites[entry["where"]][column] = entry["bytes"]
    span = (long - short) * 1024
    lines = [
        "",
        f"alive at the runner's step peak, by allocation site, {short:,} and {long:,} tokens (KiB a token):",
        "| site | at the shorter | at the longer | slope |",
        "|---|---|---|---|",
    ]
    ranked = sorted(sites.items(), key=lambda item: -(item[1][1] - item[1][0]))[:top]
    for where, (a, b) in ranked:
        lines.append(f"| {where} | {a / short / 1024:.1f} | {b / long / 1024:.1f} | {(b - a) / span:.1f} |")
    a, b = low["bytes_allocated_in_step"], high["bytes_allocated_in_step"]
    lines.append(
        f"| all allocated in the step | {a / short / 1024:.1f} | {b / long / 1024:.1f} | {(b - a) / span:.1f} |"
    )
    return lines


def long_step_lines(out: Path) -> list[str]:
    """The one long step (and its untiled twin, where measured): time, peak, loss, and the losses' difference."""
    lines = []
    steps = {
        name: json.loads(path.read_text())
        for name in ("tiled", "untiled")
        if (path := out / f"long-runner-step{'' if name == 'tiled' else '-untiled'}.json").exists()
    }
    for name, s in steps.items():
        lines.append(
            f"one step of {s['shape']} (MLPs {name}): {s['tokens_per_s']:,.0f} tok/s "
            f"({s['tokens_per_step'] / s['tokens_per_s']:.1f} s), step peak {s['peak_gib']:.2f} GiB, "
            f"loss {s['last_loss']:.6f}"
        )
    if len(steps) == 2:
        tiled, untiled = steps["tiled"]["last_loss"], steps["untiled"]["last_loss"]
        lines.append(
            f"tiled - untiled loss: {tiled - untiled:+.2e} (relative {abs(tiled - untiled) / abs(untiled):.1e})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the call's output folder")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--capacity-gb", type=float, default=H200_BYTES / 1e9, help="GPU memory in GB (1e9)")
    args = parser.parse_args()
    text = report(args.dir, args.capacity_gb * 1e9)
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
