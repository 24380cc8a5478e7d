"""Preference training steps (issue 48's bar): loralei's runner against TRL's trainer + PEFT and Unsloth's path, one
row, one objective and one checkpointing mode per process.

Every row trains the same thing: the shape's random-weight model loaded from a checkpoint on disk
(bench_runner.model_checkpoint: written once, reused), r=16 on q,k,v,o,gate,up,down, ``--pairs`` pairs a step
(default 4), each sequence (prompt + completion + eos) exactly ``--seq`` tokens (default 1024; the prompt a quarter
of it), no padding and no packing, with the ``--objective``'s settings (dpo_peers.SETTINGS):

- ``dpo`` (the bar's): sigmoid DPO with beta 0.1; each step runs 2 × pairs sequences through the policy with
  autograd and through the reference without, the reference being the same model with the adapter off (no second
  copy, nothing precomputed).
- ``simpo``: SimPO with beta 2.0, gamma 0.5 and the chosen completions' NLL at weight 1 (TRL's CPO defaults):
  reference-free, one pass with autograd.
- ``kto``: KTO with beta 0.1 and both weights 1: every row unpairs the pairs into ``2 × pairs`` examples a step
  (chosen desirable, rejected not), each beside its KL sequence (its prompt with another example's completion); the
  reference is the adapter off, in every step. tokens/s counts the examples' tokens (the pairs' sequences), not the
  KL sequences'.

The pairs are random token ids written as text (``t17 t4093 ...``, one word per id of the checkpoint's tokenizer),
as a prompt / chosen / rejected JSONL file that each row tokenizes its own way.

- ``loralei``: ``loralei.train.run.train`` (what ``loralei-finetune`` runs) on a config built here, the runner's
  defaults (fused LoRA, ``liger_kernel: auto``, ``loss: auto``, ``cuda_graphs: auto``, ``preference.share_prompt:
  auto``: where graphs stay off, each pair's prompt is run once), ``training.objective`` the objective, the data
  from the JSONL file (``data.path``), ``packing: false``, ``preference.reference: adapter_off`` for DPO, and any
  ``--preference KEY=VALUE`` (LD-DPO's ``ld_alpha``, WPO's ``use_weighting``, ``share_prompt=false``, ...);
  ``training.gradient_checkpointing`` true for ``on``, ``offload`` for ``offload`` (judged against the peers'
  ``on``: Unsloth's checkpointing offloads too).
- ``trl-peft`` and ``unsloth``: dpo_peers.py says what they do.

The warm-up steps are untimed; a bench_runner.StepClock callback times the rest between two device syncs and
reads the step peak (allocated and reserved bytes since the counters were reset after the setup: loading, LoRA,
the trainer). tokens/s counts every token of both sequences of every pair. With ``--profile FILE.json`` the loralei
row runs one more step after the timed ones under the profiler (bench_runner's summary of it, in FILE.json).
Unsloth patches Transformers, PEFT and TRL when imported, so its row re-executes this script with Unsloth imported
first.

    python benchmarks/bench_dpo.py --row loralei --checkpointing off --model-dir /tmp/bench-ckpt-llama3-8b \
        --out OUT/dpo-loralei-off.json
    python benchmarks/bench_dpo.py --row trl-peft --checkpointing on --out OUT/dpo-trl-peft-on.json
    python benchmarks/bench_dpo.py --row trl-peft --objective simpo --out OUT/simpo-trl-peft-off.json
    python benchmarks/bench_dpo.py --summary OUT/dpo-*.json --out OUT/dpo.md   # the table and the bar's verdict
"""

from __future__ import annotations

import preimport  # first of all: see preimport.py

# isort: split
import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import transformers
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_runner
from bench_results import installed_versions
from bench_rows import SHAPES, is_moe
from bench_train_step import CHILD_ENV
from dpo_peers import (
    PEER_ROWS,
    REFERENCED,
    SETTINGS,
    base_as_reference,
    build_trainer,
    check_step,
    describe,
    examples_per_step,
    reference_of,
    sequence_tokens,
)
from dpo_table import summary

from loralei.train.build import default_device
from loralei.train.metrics import read_log
from loralei.train.run import train
from loralei.train.schema import validate_config

ROWS = ("loralei", *PEER_ROWS)
RUNNER_ROW = "loralei-finetune's runner with its defaults, training.objective: {objective}"
NO_REFERENCE = "none (reference-free)"
FIRST_ID = 4  # the checkpoint tokenizer's ids 0-3 are <unk>, <s>, </s>, <pad> (bench_rows.vocab_tokenizer)


def words(ids: torch.Tensor) -> str:
    """Token ids as the checkpoint tokenizer's words, one each."""
    return " ".join(f"t{i}" for i in ids.tolist())


def pair_rows(vocab_size: int, count: int, seq: int, prompt_tokens: int) -> list[dict[str, str]]:
    """``count`` preference rows (seeded): a prompt of ``prompt_tokens`` random ids, two different completions of
    ``seq - prompt_tokens - 1`` ids each (every row's tokenizer appends eos: ``seq`` tokens a sequence)."""
    completion = seq - prompt_tokens - 1
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(FIRST_ID, vocab_size, (count, prompt_tokens + 2 * completion), generator=g)
    prompts, chosen, rejected = ids.split([prompt_tokens, completion, completion], dim=1)
    return [
        {"prompt": words(p), "chosen": " " + words(c), "rejected": " " + words(r)}
        for p, c, r in zip(prompts, chosen, rejected, strict=True)
    ]


def write_pairs(rows: list[dict[str, str]], path: Path) -> Path:
    """The rows as a JSONL file."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def runner_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench_runner's arguments for this run (its defaults: Liger, CUDA graphs, no compile, no quantization)."""
    flags = ["--shape", args.shape, "--checkpointing", args.checkpointing, "--dtype", args.dtype]
    flags += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(args.out)]
    flags += ["--profile", str(args.profile)] if args.profile else []
    return bench_runner.parse_args(flags)


def runner_config(args: argparse.Namespace, model_dir: Path, data: Path, out_dir: Path) -> dict:
    """bench_runner's config of the runner with its defaults, turned to the objective on the pairs in ``data``."""
    cfg = bench_runner.run_config(runner_args(args), out_dir, model_dir)
    cfg["data"] = {"path": str(data)}
    batch = examples_per_step(args)
    cfg["training"] |= {"objective": args.objective, "max_seq_length": args.seq, "batch_size": batch}
    cfg["training"] |= dict(args.training)
    reference = {"reference": "adapter_off"} if args.objective in REFERENCED else {}
    cfg["preference"] = SETTINGS[args.objective] | reference | dict(args.preference)
    return cfg


def measure_loralei(
    args: argparse.Namespace, model_dir: Path, data: Path, scratch: Path
) -> tuple[dict, bench_runner.StepClock]:
    """The runner's row: its setup peak from the runner, the clock's step peak and times."""
    device = default_device()
    raw = runner_config(args, model_dir, data, scratch / "run")
    cfg = validate_config(raw)
    clock = bench_runner.StepClock(args.warmup, args.warmup + args.steps, device)
    last = bench_runner.total_steps(runner_args(args))
    profiler = bench_runner.StepProfile(last, last, device) if args.profile else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = train(cfg, callbacks=[clock, *([profiler] if profiler else [])])
    if profiler is not None:  # after the timed steps, their clock unchanged
        seconds = (clock.stop - clock.start) / args.steps
        bench_runner.write_profile(runner_args(args), profiler, seconds)
    return {
        "setup_peak_gib": result.memory_gib.get("setup"),
        "reference": "adapter off" if args.objective in REFERENCED else NO_REFERENCE,
        "preference": raw["preference"],
        "training_settings": dict(args.training),
        "adapter": result.adapter,
        "data": result.data,
        "last_loss": result.last_loss,
        # every logged window's mean loss: one for the whole run, one a step with --training logging_steps=1
        "logged_losses": [r["loss"] for r in read_log(result.output_dir) if "loss" in r],
        "runner_notes": result.setup_notes,
        "notes": result.notes,
        "autotuned": bench_runner.autotuned(),
    }, clock


def measure_peer(
    args: argparse.Namespace, model_dir: Path, data: Path, scratch: Path
) -> tuple[dict, bench_runner.StepClock]:
    """A peer's row: its trainer built (setup peak), then trained."""
    device = default_device()
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    clock = bench_runner.StepClock(args.warmup, args.warmup + args.steps, device)
    trainer = build_trainer(args.row, args, model_dir, rows, scratch / "run", clock)
    check_step(trainer, args)
    reference_note = base_as_reference(trainer)
    setup_peak = None
    if device.type == "cuda":
        setup_peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    output = trainer.train()
    return {
        "setup_peak_gib": setup_peak,
        "reference": reference_of(trainer.model) if args.objective in REFERENCED else NO_REFERENCE,
        "reference_note": reference_note,
        "sequence_tokens": sequence_tokens(trainer),
        "last_loss": output.training_loss,
    }, clock


def measure(args: argparse.Namespace) -> dict:
    """One row, one checkpointing mode: the checkpoint (written when missing), the pairs, the timed steps."""
    device = default_device()
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    vocab = SHAPES[args.shape][1]["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as tmp:
        scratch = Path(tmp)
        model_dir = bench_runner.model_checkpoint(
            runner_args(args), args.model_dir or scratch / "model", device, dtype
        )
        count = args.pairs * bench_runner.total_steps(runner_args(args))
        data = write_pairs(pair_rows(vocab, count, args.seq, args.prompt_tokens), scratch / "pairs.jsonl")
        row_measure = measure_loralei if args.row == "loralei" else measure_peer
        extra, clock = row_measure(args, model_dir, data, scratch)
    seconds = (clock.stop - clock.start) / args.steps
    return {
        "shape": args.shape,
        "row": args.row,
        "objective": args.objective,
        "what": (
            RUNNER_ROW.format(objective=args.objective)
            if args.row == "loralei"
            else describe(args.row, args.liger, args.objective)
        ),
        "checkpointing": args.checkpointing,
        "liger": args.liger if args.row == "trl-peft" else None,
        "pairs": args.pairs,
        "seq": args.seq,
        "prompt_tokens": args.prompt_tokens,
        "tokens_per_s": 2 * args.pairs * args.seq / seconds,
        "step_ms": seconds * 1e3,
        "peak_gib": clock.peak_gib,
        "peak_reserved_gib": clock.reserved_gib,
        **extra,
        "loaded_from": "disk",
        "host_peak_gib": bench_runner.host_peak_gib(),
        "steps": args.steps,
        "warmup": args.warmup,
        "host_step_ms": clock.host_ms,
        "gpu_step_ms": clock.gpu_ms,
        "gc_runs": clock.gc_runs,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__}
        | installed_versions(),
    }


def failed(args: argparse.Namespace, error: str) -> dict:
    """A row that could not be measured: it stays in the table with its error."""
    return {
        "shape": args.shape,
        "row": args.row,
        "objective": args.objective,
        "checkpointing": args.checkpointing,
    } | {
        "tokens_per_s": None,
        "peak_gib": None,
        "error": error,
    }


def setting(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` as the key and VALUE read as YAML (``true``, ``0.5``, ``[sigmoid, sft]``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: write KEY=VALUE, e.g. use_weighting=true")
    return key, yaml.safe_load(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=ROWS, default="loralei")
    parser.add_argument(
        "--objective", choices=sorted(SETTINGS), default="dpo", help="what every row trains (dpo: the bar's)"
    )
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(s for s in SHAPES if not is_moe(s)))
    parser.add_argument(
        "--checkpointing",
        default="off",
        choices=["off", "on", "offload"],
        help="offload (the loralei row only): gradient_checkpointing: offload, judged against the peers' 'on'",
    )
    parser.add_argument("--pairs", type=int, default=4, help="preference pairs a step")
    parser.add_argument("--seq", type=int, default=1024, help="tokens of each sequence (prompt + completion)")
    parser.add_argument(
        "--prompt-tokens", type=int, help="tokens of each prompt (default: a quarter of --seq)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--no-liger", dest="liger", action="store_false", help="trl-peft: without use_liger_kernel"
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="the shape's random-weight checkpoint: written when it holds none, reused when it holds the shape's",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="JSON file of the result (or --summary's table)"
    )
    parser.add_argument(
        "--preference",
        type=setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the loralei row: one more preference setting (a YAML value), e.g. use_weighting=true; repeatable",
    )
    parser.add_argument(
        "--training",
        type=setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the loralei row: one more training setting, e.g. pad_to_max_length=true (CUDA graphs under auto: "
        "the pairs' rows are all --seq tokens, but auto wants it said) or cuda_graphs=false; repeatable",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="the loralei row: profile one more step after the timed ones (bench_runner's summary, to this file)",
    )
    parser.add_argument(
        "--summary",
        type=Path,
        nargs="+",
        help="measure nothing: one markdown table of these rows' JSON files",
    )
    args = parser.parse_args(argv)
    if args.profile and args.row != "loralei":
        parser.error("--profile is the loralei row's (bench_runner's step profile)")
    if args.preference and args.row != "loralei":
        parser.error("--preference is the loralei row's (the peers train dpo_peers.SETTINGS)")
    if args.training and args.row != "loralei":
        parser.error("--training is the loralei row's (the runner's training section)")
    if args.checkpointing == "offload" and args.row != "loralei":
        parser.error(f"--checkpointing offload is the runner's mode; the {args.row} row runs off or on")
    args.prompt_tokens = args.seq // 4 if args.prompt_tokens is None else args.prompt_tokens
    if not 0 < args.prompt_tokens < args.seq - 1:
        parser.error(f"--prompt-tokens {args.prompt_tokens} leaves no completion in --seq {args.seq}")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.summary is not None:
        print(summary(args.summary, args.out), end="")
        return None
    if args.row == "unsloth" and preimport.NAME != "unsloth":  # start again with Unsloth imported first
        env = os.environ | CHILD_ENV | {"LORALEI_BENCH_PREIMPORT": "unsloth"}
        os.execve(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)], env)
    try:
        if preimport.ERROR is not None:
            raise ImportError(preimport.ERROR)
        result = measure(args)
    except Exception as err:
        traceback.print_exc()
        result = failed(args, f"{type(err).__name__}: {err}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(1 if "error" in (main() or {}) else 0)
