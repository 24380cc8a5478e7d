"""Data preparation at scale: ``loralei-finetune`` on a generated chat dataset, cold, warm, and with another
``max_seq_length``, each run to the end of its first training step.

The dataset (``--rows`` rows, default 100,000) is generated into a temporary directory, deterministically from
``--seed``: multi-turn chats (an optional system prompt, one to three user/assistant exchanges) of words drawn
from a fixed made-up vocabulary, their lengths log-normally spread around ~1,250 characters, which the quickstart's
character-level tokenizer (``examples/quickstart/model``) makes ~1,300 tokens a row; a few percent of the rows
are longer than 2,048 tokens. Three runs of the runner follow, each in its own process, on the quickstart model
with ``training.max_steps: 1`` and packing on:

* ``cold``: a fresh token cache (``LORALEI_CACHE_DIR``) and datasets cache (``HF_DATASETS_CACHE``);
* ``warm``: the same command again (the tokens come from the cache);
* ``max_seq_length``: ``--changed-max-seq-length`` instead (must come from the cache too).

Per run: ``first_step_s``, from the process's start to the moment the run's ``log.jsonl`` holds its first record
(written right after step 1; polled every 50 ms, so up to 50 ms late); ``process_s``, the whole process (an upper
bound: it also saves the adapters and draws the loss plot); the peak over the run of the process tree's summed RSS
(the main process and its tokenization workers at the same moment, from ``/proc`` every 50 ms) and of its summed
PSS (shared pages split between the processes that map them); the CPU seconds of the tree; and whether the token
cache was filled or reused (its entries before and after the run).

    python benchmarks/bench_data_prep.py                 # writes benchmarks/results/<date>-cpu<N>-data-prep-<commit>
    python benchmarks/bench_data_prep.py --rows 2000 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "quickstart" / "model"
RESULTS = REPO / "benchmarks" / "results"
POLL_S = 0.05
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# The bars this benchmark checks (2 cores, 100,000 rows): seconds to the first step, and the tree's peak RSS.
BARS = {"cold_first_step_s": 60.0, "warm_first_step_s": 8.0, "peak_rss_mib": 1.2 * 1024}


def _vocabulary(seed: int) -> list[str]:
    rng = random.Random(seed)
    sizes = (1, 2, 2, 3, 3, 4, 4, 4, 5, 5, 6, 6, 7, 8, 9, 11)
    return ["".join(rng.choices(LETTERS, k=rng.choice(sizes))) for _ in range(4000)]


def _text(rng: random.Random, words: list[str], chars: int) -> str:
    picked = rng.choices(words, k=max(1, chars // 5))
    out, size = [], 0
    for word in picked:
        if rng.random() < 0.07:
            word = word.capitalize()
        if rng.random() < 0.08:
            word += rng.choice(",.?!:")
        out.append(word)
        size += len(word) + 1
        if size >= chars:
            break
    return " ".join(out)


def chat_rows(count: int, seed: int, chars: int = 1150) -> list[dict]:
    """``count`` chat rows, the same for the same seed (see the module docstring); ``chars``: the median
    characters of content a row."""
    rng, words = random.Random(seed), _vocabulary(seed)
    rows = []
    for _ in range(count):
        total = max(60, int(rng.lognormvariate(math.log(chars), 0.3)))
        exchanges = rng.choice((1, 1, 2, 2, 3))
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": _text(rng, words, rng.randint(20, 120))})
        for _ in range(exchanges):
            share = total // exchanges
            asked = int(share * rng.uniform(0.15, 0.45))
            messages.append({"role": "user", "content": _text(rng, words, asked)})
            messages.append({"role": "assistant", "content": _text(rng, words, share - asked)})
        rows.append({"messages": messages})
    return rows


def write_dataset(path: Path, count: int, seed: int, chars: int) -> dict:
    """Writes the rows as JSON lines; returns their count, size and mean characters of content a row."""
    rows = chat_rows(count, seed, chars)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    chars = sum(len(m["content"]) for row in rows for m in row["messages"])
    return {"rows": count, "seed": seed, "bytes": path.stat().st_size, "mean_content_chars": chars / count}


def write_config(path: Path, data: Path, output_dir: Path, max_seq_length: int) -> None:
    """A quickstart-like config: one packed training step."""
    config = {
        "model": {"name_or_path": str(MODEL), "dtype": "float32"},
        "lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"},
        "data": {"path": str(data), "messages_field": "messages"},
        "training": {
            "max_seq_length": max_seq_length,
            "packing": True,
            "batch_size": 1,
            "max_steps": 1,
            "logging_steps": 1,
            "seed": 0,
        },
        "optimizer": {"name": "adamw", "lr": 1.0e-3, "warmup_steps": 0},
        "output_dir": str(output_dir),
        "overwrite_output_dir": True,
    }
    path.write_text(json.dumps(config))  # JSON is YAML


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _field_kib(path: str, name: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory(root: int) -> tuple[int, int, int]:
    """The summed RSS and PSS (KiB) of ``root`` and its descendants, and how many processes that is."""
    tree, pids, at = _children(), [root], 0
    while at < len(pids):
        pids += tree.get(pids[at], [])
        at += 1
    rss = sum(_field_kib(f"/proc/{pid}/status", "VmRSS:") for pid in pids)
    pss = sum(_field_kib(f"/proc/{pid}/smaps_rollup", "Pss:") for pid in pids)
    return rss, pss, len(pids)


def _cache_entries(cache: Path) -> set[str]:
    tokens = cache / "tokens"
    return {p.name for p in tokens.iterdir() if not p.name.startswith(".")} if tokens.is_dir() else set()


def _command() -> list[str]:
    script = Path(sys.executable).with_name("loralei-finetune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "loralei.cli"]


@dataclass
class Run:
    name: str
    max_seq_length: int


@dataclass
class Watch:
    """What polling a running process saw."""

    first_step_s: float | None = None
    peak_rss_kib: int = 0
    peak_pss_kib: int = 0
    most_processes: int = 0

    def poll(self, pid: int, log: Path, elapsed: float) -> None:
        rss, pss, count = tree_memory(pid)
        self.peak_rss_kib, self.peak_pss_kib = max(self.peak_rss_kib, rss), max(self.peak_pss_kib, pss)
        self.most_processes = max(self.most_processes, count)
        if self.first_step_s is None and log.exists() and log.read_text().strip():
            self.first_step_s = elapsed


def _follow(proc: subprocess.Popen, log: Path, sink: Path, started: float) -> tuple[Watch, int, float]:
    """Polls the process until it exits; returns what was seen, its exit code and its tree's CPU seconds."""
    watch = Watch()
    os.set_blocking(proc.stdout.fileno(), False)
    with sink.open("wb") as out:
        while True:
            watch.poll(proc.pid, log, time.perf_counter() - started)
            while chunk := proc.stdout.read(1 << 16):
                out.write(chunk)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # its usage counts the workers it waited for
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                out.write(proc.stdout.read() or b"")
                return watch, proc.returncode, usage.ru_utime + usage.ru_stime
            time.sleep(POLL_S)


def measure(run: Run, work: Path, data: Path, env: dict[str, str]) -> dict:
    """Runs ``loralei-finetune`` once and measures it (see the module docstring)."""
    out, config, sink = work / f"out-{run.name}", work / f"{run.name}.yaml", work / f"{run.name}.out"
    write_config(config, data, out, run.max_seq_length)
    before = _cache_entries(Path(env["LORALEI_CACHE_DIR"]))
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*_command(), str(config)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    watch, code, cpu = _follow(proc, out / "log.jsonl", sink, started)
    process_s = time.perf_counter() - started
    output = sink.read_text(errors="replace").replace("\r", "\n")
    after = _cache_entries(Path(env["LORALEI_CACHE_DIR"]))
    return {
        "run": run.name,
        "max_seq_length": run.max_seq_length,
        "returncode": code,
        "first_step_s": watch.first_step_s,
        "process_s": process_s,
        "peak_rss_mib": watch.peak_rss_kib / 1024,
        "peak_pss_mib": watch.peak_pss_kib / 1024,
        "most_processes": watch.most_processes,
        "cpu_s": cpu,
        "cache": "filled" if after - before else ("reused" if after and after == before else "none"),
        "data_line": next(
            (ln.strip() for ln in output.splitlines() if ln.strip().startswith("data: ")), None
        ),
        "phases": _phases(out),
        "last_lines": [ln for ln in output.strip().splitlines() if ln.strip()][-3:],
    }


def _phases(out: Path) -> dict[str, float]:
    """The seconds of the run's phases, as its ``run_summary.json`` records them (empty if it has none)."""
    summary = out / "run_summary.json"
    return json.loads(summary.read_text()).get("phases", {}) if summary.is_file() else {}


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """What the numbers depend on: the machine, its load when the benchmark started, the libraries."""
    import numpy
    import tokenizers
    import torch
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "cores": len(os.sched_getaffinity(0)),
        "load_average_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": numpy.__version__,
    }


def check_bars(runs: list[dict]) -> dict[str, bool]:
    """Which bars the runs meet (the time bars assume an otherwise idle machine of 2 cores and 100,000 rows)."""
    by_name = {r["run"]: r for r in runs}

    def within(value: float | None, bar: float) -> bool:
        return value is not None and value <= bar

    return {
        "cold_first_step_s": within(by_name["cold"]["first_step_s"], BARS["cold_first_step_s"]),
        "warm_first_step_s": within(by_name["warm"]["first_step_s"], BARS["warm_first_step_s"]),
        "peak_rss_mib": all(within(r["peak_rss_mib"], BARS["peak_rss_mib"]) for r in runs),
        "max_seq_length_reuses_the_cache": by_name["max_seq_length"]["cache"] == "reused",
    }


def write_results(results: dict, out_dir: Path, tag: str) -> Path:
    """Writes ``<tag>.json`` and ``<tag>.md`` into ``out_dir``; returns the markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{tag}.json").write_text(json.dumps(results, indent=2) + "\n")
    d = results["dataset"]
    lines = [
        f"# Data preparation benchmark ({tag})",
        "",
        "| " + " | ".join(f"{k}: {v}" for k, v in results["env"].items()) + " |",
        "",
        f"{d['rows']:,} generated chat rows (seed {d['seed']}, {d['bytes'] / 2**20:.0f} MiB of JSON lines, "
        f"{d['mean_content_chars']:,.0f} characters of content a row), quickstart model and tokenizer, one packed "
        f"step. Command: `{results['command']}`",
        "",
        "| run | max_seq_length | to first step s | whole process s | the run's phases s | peak RSS MiB (tree) | "
        "peak PSS MiB | processes | CPU s | token cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        first = "failed" if r["first_step_s"] is None else f"{r['first_step_s']:.1f}"
        phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in r.get("phases", {}).items())
        lines.append(
            f"| {r['run']} | {r['max_seq_length']} | {first} | {r['process_s']:.1f} | {phases} | "
            f"{r['peak_rss_mib']:,.0f} | {r['peak_pss_mib']:,.0f} | {r['most_processes']} | {r['cpu_s']:.1f} | "
            f"{r['cache']} |"
        )
    lines += ["", "| bar | limit | met |", "|---|---|---|"]
    lines += [f"| {name} | {BARS.get(name, 'yes')} | {met} |" for name, met in results["bars_met"].items()]
    lines += ["", "The runs' data summary lines:", ""]
    lines += [f"- {r['run']}: `{r['data_line']}`" for r in results["runs"]]
    path = out_dir / f"{tag}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--row-chars", type=int, default=1150, help="median characters of content a row")
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--changed-max-seq-length", type=int, default=4096)
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help="directory of the JSON and markdown results"
    )
    parser.add_argument(
        "--tag", default=None, help="file name stem (default: <date>-cpu<N>-data-prep-<commit>)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    env_info = environment()
    tag = args.tag or f"{env_info['date']}-cpu{env_info['cores']}-data-prep-{env_info['commit']}"
    runs = [
        Run("cold", args.max_seq_length),
        Run("warm", args.max_seq_length),
        Run("max_seq_length", args.changed_max_seq_length),
    ]
    with tempfile.TemporaryDirectory(prefix="bench-data-prep-") as tmp:
        work = Path(tmp)
        data = work / "chat.jsonl"
        dataset = write_dataset(data, args.rows, args.seed, args.row_chars)
        env = {
            **os.environ,
            "LORALEI_CACHE_DIR": str(work / "cache"),
            "HF_DATASETS_CACHE": str(work / "hf-datasets"),
            "PYTHONUNBUFFERED": "1",
        }
        measured = [measure(run, work, data, env) for run in runs]
    results = {
        "env": env_info,
        "dataset": dataset,
        "command": "python benchmarks/bench_data_prep.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "bars": BARS,
        "bars_met": check_bars(measured),
        "runs": measured,
    }
    print(write_results(results, args.out, tag).read_text())
    return results


if __name__ == "__main__":
    main()
