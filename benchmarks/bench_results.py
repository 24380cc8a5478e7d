"""The train-step benchmark's results: one dict per measured (or failed) row, ratios to the PEFT bf16-adapter row,
the JSON and markdown files, and the versions of the libraries compared."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from bench_rows import SHAPES


def row_result(
    shape: str, row: str, checkpointing: bool, liger: bool, seconds: float, peak: float | None
) -> dict:
    _, _, batch_size, seq = SHAPES[shape]
    return {
        "shape": shape,
        "row": row + ("+liger" if liger else ""),
        "checkpointing": checkpointing,
        "tokens_per_s": batch_size * seq / seconds,
        "peak_gib": peak,
    }


def failed_row(shape: str, row: str, checkpointing: bool, liger: bool, error: str) -> dict:
    """A row that could not be measured: it stays in the table with its error."""
    return {
        "shape": shape,
        "row": row + ("+liger" if liger else ""),
        "checkpointing": checkpointing,
        "tokens_per_s": None,
        "peak_gib": None,
        "error": error,
    }


def write_results(results: dict, out_dir: Path, tag: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{tag}.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Train-step benchmark ({tag})",
        "",
        "| " + " | ".join(f"{k}: {v}" for k, v in results["env"].items()) + " |",
        "",
    ]
    lines += [
        "| shape | row | checkpointing | tokens/s | peak GiB | vs peft-bf16-adapters |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["steps"]:
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "n/a"
        speed = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else failure_cell(r["error"])
        lines.append(f"| {r['shape']} | {r['row']} | {r['checkpointing']} | {speed} | {peak} | {ratio} |")
    lines += ["", "| shape | op (fwd+bwd) | fused ms | plain ms | speedup |", "|---|---|---|---|---|"]
    lines += [
        f"| {m['shape']} | {m['op']} | {m['fused_ms']:.3f} | {m['plain_ms']:.3f} | {m['speedup']:.2f} |"
        for m in results["ops"]
    ]
    (out_dir / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def failure_cell(error: str) -> str:
    """A failed row's error, short enough for a table cell and without the table's separators."""
    first = error.splitlines()[0] if error else "unknown error"
    return "failed: " + (first[:77] + "..." if len(first) > 80 else first).replace("|", "/")


def add_ratios(steps: list[dict]) -> None:
    base = {
        (r["shape"], r["checkpointing"]): r["tokens_per_s"]
        for r in steps
        if r["row"].startswith("peft-bf16-adapters") and r["tokens_per_s"] is not None
    }
    for r in steps:
        if (r["shape"], r["checkpointing"]) in base and r["tokens_per_s"] is not None:
            r["ratio"] = r["tokens_per_s"] / base[(r["shape"], r["checkpointing"])]


def installed_versions() -> dict[str, str]:
    """Versions of the competitor libraries that are installed, read from their metadata: importing Unsloth
    here would patch this process."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in (
        "peft",
        "trl",
        "bitsandbytes",
        "unsloth",
        "unsloth_zoo",
        "liger-kernel",
        "torchao",
        "gptqmodel",
        "optimum",
    ):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found
