"""bench_dpo.py's table: its rows' JSON files as one markdown table, and issue 48's bar per checkpointing mode.

The bar (DPO's; rows of another objective are tabled, not judged): the ``loralei`` row at >= 1.5x the ``trl-peft``
row's tokens/s and >= 1.2x the ``unsloth`` row's, with a step peak no higher than the leaner peer's (the lower of
the two peers' step peaks), checkpointing off and on; the runner's ``offload`` row is judged against the peers'
``on`` rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench_results import failure_cell

BAR = {"trl-peft": 1.5, "unsloth": 1.2}  # the loralei row's least speed-up over each peer
JUDGED_AGAINST = {"offload": "on"}  # the loralei row's mode -> the peers' mode it is judged against
HEAD = (
    "| row | checkpointing | tokens/s | step peak GiB | setup peak GiB | reference | loralei vs row |\n"
    "|---|---|---|---|---|---|---|"
)


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def table_line(row: dict, base: dict | None) -> str:
    """One row of the table; ``base`` is the loralei row of the same mode (None when it has none)."""
    speed = row.get("tokens_per_s")
    cell = f"{speed:,.0f}" if speed is not None else failure_cell(row.get("error", ""))
    ratio = "n/a"
    if base is not None and base.get("tokens_per_s") and speed:
        ratio = f"{base['tokens_per_s'] / speed:.2f}x"
    return (
        f"| {row['row']} | {row['checkpointing']} | {cell} | {gib(row.get('peak_gib'))} | "
        f"{gib(row.get('setup_peak_gib'))} | {row.get('reference', 'n/a')} | {ratio} |"
    )


def verdict(mode: str, rows: dict[str, dict]) -> str:
    """Whether the loralei row of ``mode`` meets the bar against the peers measured in it."""
    ours = rows.get("loralei")
    peers = {name: rows[name] for name in BAR if rows.get(name, {}).get("tokens_per_s")}
    if not ours or not ours.get("tokens_per_s") or len(peers) < len(BAR):
        return f"- checkpointing {mode}: not judged (a row is missing or failed)"
    parts, met = [], True
    for name, least in BAR.items():
        speedup = ours["tokens_per_s"] / peers[name]["tokens_per_s"]
        met &= speedup >= least
        parts.append(f"{speedup:.2f}x {name} (bar {least}x)")
    peaks = {name: row["peak_gib"] for name, row in peers.items() if row.get("peak_gib") is not None}
    if peaks and ours.get("peak_gib") is not None:
        leaner = min(peaks, key=peaks.get)
        met &= ours["peak_gib"] <= peaks[leaner]
        parts.append(f"step peak {ours['peak_gib']:.1f} GiB vs {leaner}'s {peaks[leaner]:.1f} GiB")
    else:
        parts.append("no step peaks (no CUDA)")
    return f"- checkpointing {mode}: " + ", ".join(parts) + (": met" if met else ": NOT met")


def summary(paths: list[Path], out: Path) -> str:
    """The table of the rows in ``paths`` (in the order given) and the bar's verdicts, written to ``out``."""
    rows = [json.loads(path.read_text()) for path in paths]
    by_mode: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_mode.setdefault(row["checkpointing"], {})[row["row"]] = row
    first = next((row for row in rows if "pairs" in row), None)
    objectives = sorted({row.get("objective", "dpo") for row in rows})
    lines = [f"# Preference training steps: {', '.join(objectives)}", ""]
    if first is not None:
        versions = {name: v for row in rows for name, v in row.get("versions", {}).items()}
        lines += [
            f"{first['shape']}, {first['pairs']} pairs × 2 × {first['seq']} tokens a step, {first['warmup']} warm-up "
            f"and {first['steps']} timed steps, {first['device']}; "
            + ", ".join(f"{name} {version}" for name, version in versions.items()),
            "",
        ]
    lines += [HEAD, *(table_line(row, by_mode[row["checkpointing"]].get("loralei")) for row in rows)]
    what = {row["row"]: row["what"] for row in rows if "what" in row}
    lines += ["", *(f"- {name}: {line}" for name, line in what.items())]
    judged = {
        mode: by_mode.get(JUDGED_AGAINST.get(mode, mode), {}) | {"loralei": found.get("loralei")}
        for mode, found in by_mode.items()
        if "loralei" in found
    }
    if objectives != ["dpo"]:
        lines += ["", "Issue 48's bar is DPO's: not judged on these rows."]
    else:
        lines += ["", "Issue 48's bar:", *(verdict(mode, found) for mode, found in judged.items())]
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text
