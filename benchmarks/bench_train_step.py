"""Full LoRA training steps: PEFT vs loralei unfused vs loralei fused, one process, same random inputs.

Random-weight models of real shapes, r=16, alpha=32 on q,k,v,o,gate,up,down, bf16, SDPA, AdamW (fused on
CUDA); with and without gradient checkpointing. Prints and writes (JSON + markdown, under --out-dir)
tokens/s, peak allocated GiB and the ratio to the PEFT bf16-adapter row, plus op microbenchmarks (fwd+bwd).
`--liger` applies Liger's RMSNorm / RoPE / SwiGLU / fused linear cross entropy to every row (Liger patches
classes globally, so run it as its own process); the loralei-fused row keeps its own fused MLP instead of
Liger's SwiGLU.

MoE shapes (`qwen3-30b-a3b-8l`, `tiny-moe`) adapt q,k,v,o and the experts' packed banks (`target_parameters`
in PEFT and loralei; Unsloth maps gate/up/down onto the banks itself); `peft-eager-experts` is PEFT on
Transformers' expert-by-expert loop instead of its grouped GEMMs. They have no op microbenchmarks.

QLoRA rows: `peft-bnb-nf4` (PEFT on a bitsandbytes NF4 model), `unsloth-bf16` / `unsloth-4bit` and the
loralei QLoRA rows `loralei-nf4`, `loralei-nf4-triton`, `loralei-int4`, `loralei-fp8` (CUDA; FP8 GEMMs need
compute capability >= 8.9). Rows that patch libraries globally
(Unsloth) run in a child process of this script (one per shape and library), which writes its rows as JSON for
this process to merge into the one table; `--isolate ROW` sends any other row there too.

GPTQ row: `peft-gptq` (issue 47's peer) is PEFT LoRA on the GPTQ copy of the shape's checkpoint
(gptq_checkpoint.py: 4-bit RTN in GPTQ's v1 layout, written once beside it as CHECKPOINT-gptq, the directory
`bench_runner.py --gptq` reads too), loaded through Transformers' GPTQ integration (optimum + gptqmodel, whose
Triton kernel on CUDA, torch on CPU: they train). It runs in a child that imported gptqmodel first (which patches
libraries and sets PYTORCH_ALLOC_CONF where unset), and needs the `gptq` wheels of fetch_wheels.sh.

This file is the driver (timing, child processes, command line); the shapes and how each row's model is built
are in bench_rows.py, the result rows and files in bench_results.py, the op microbenchmarks in bench_ops.py.

    python benchmarks/bench_train_step.py --shape llama3-8b           # on an H200
    python benchmarks/bench_train_step.py --tiny                      # CPU smoke run (ratios only)
    python benchmarks/bench_train_step.py --rows peft-bf16-adapters peft-bnb-nf4 unsloth-4bit loralei-nf4
    python benchmarks/bench_train_step.py --shape qwen3-30b-a3b-8l --rows peft-bf16-adapters loralei-fused
    python benchmarks/bench_train_step.py --tiny --shape tiny-moe --rows peft-bf16-adapters peft-eager-experts
    python benchmarks/bench_train_step.py --rows peft-gptq --checkpoint-dir /tmp/bench-ckpt-llama3-8b
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers

# the package under test, and this folder's modules (also when this file is loaded by path, as the tests do)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import gc_collections, micro, sync
from bench_results import add_ratios, failed_row, installed_versions, row_result, write_results
from bench_rows import (
    DEFAULT_ROWS,
    FROM_CHECKPOINT,
    FUSED_ROWS,
    ISOLATED,
    ROWS,
    SHAPES,
    model_loss,
    prepared_model,
    release,
    row_loss,
    save_checkpoint,
)

TINY_SHAPES = ("tiny", "tiny-moe")  # the shapes of --tiny's CPU smoke runs
# Hugging Face libraries must not reach for the network there, and Unsloth must not report usage.
CHILD_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
}
# The child's entry point: imports the library named in LORALEI_BENCH_PREIMPORT before this script (and so
# transformers and peft) is imported, since Unsloth patches their classes at import and must come first.
CHILD_BOOT = (
    "import os, runpy, sys\n"
    "first = os.environ.get('LORALEI_BENCH_PREIMPORT')\n"
    "if first: __import__(first)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The benchmark's optimizer: AdamW over the trainable parameters, fused on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def batch_ids(shape: str, device: torch.device, seed: int = 1) -> torch.Tensor:
    """The shape's (batch, seq) token ids, the same for every row (seeded)."""
    _, cfg, batch_size, seq = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg["vocab_size"], (batch_size, seq), generator=g).to(device)


def train_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, steps: int, loss=model_loss
) -> None:
    """``steps`` full training steps: forward with the ids as labels (``loss``: see bench_rows.row_loss),
    backward, optimizer step."""
    for _ in range(steps):
        loss(model, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def time_steps(
    model, ids: torch.Tensor, steps: int, warmup: int, device: torch.device, loss=model_loss
) -> tuple[float, float | None, int]:
    """Seconds per full step (forward, backward, AdamW), peak allocated GiB (None off CUDA) and the full garbage
    collections inside the timed steps (each walks every Python object of the process, a few hundred ms with
    a model and its libraries loaded: a row that had one is slower for it)."""
    opt = adamw(model, device)
    train_steps(model, opt, ids, warmup, loss)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    full = gc_collections()[2]
    start = time.perf_counter()
    train_steps(model, opt, ids, steps, loss)
    sync(device)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return seconds, peak, gc_collections()[2] - full


def run_row(
    shape: str, row: str, checkpointing: bool, args, device, dtype, checkpoint: Path | None = None
) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = prepared_model(shape, row, args.liger, checkpointing, device, dtype, checkpoint)
    setup_peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    ids = batch_ids(shape, device)
    seconds, peak, collections = time_steps(model, ids, args.steps, args.warmup, device, row_loss(row))
    del model
    release(device)
    return row_result(shape, row, checkpointing, args.liger, seconds, peak) | {
        "setup_peak_gib": setup_peak,
        "loaded_from": "disk" if checkpoint is not None else "built in place",
        "gc_full_collections": collections,
    }


def guarded_row(
    shape: str, row: str, checkpointing: bool, args, device, dtype, checkpoint: Path | None
) -> dict:
    """run_row, with a failure recorded as the row's result: one broken row (a missing package, an API that
    moved) must not cost a GPU run the other rows' numbers."""
    try:
        return run_row(shape, row, checkpointing, args, device, dtype, checkpoint)
    except Exception as err:
        traceback.print_exc()
        release(device)
        return failed_row(shape, row, checkpointing, args.liger, f"{type(err).__name__}: {err}")


def liger_apart(args) -> list[str]:
    """With --liger, loralei's fused rows run in a child when other rows share the process: Liger replaces the
    family's MLP class globally for the rows that take its SwiGLU, and a model built afterwards in the same
    process gets Liger's MLP instead of the one loralei fuses."""
    fused = [row for row in args.rows if row in FUSED_ROWS]
    others = [row for row in args.rows if row not in FUSED_ROWS and row not in ISOLATED]
    return fused if args.liger and fused and others else []


def child_groups(args) -> dict[str, list[str]]:
    """The rows to run in child processes, by the module each child imports first ("" for none). A child
    itself (--child-json) runs all its rows in-process."""
    if args.child_json is not None:
        return {}
    groups: dict[str, list[str]] = {}
    isolate = {*args.isolate, *liger_apart(args)}
    for row in args.rows:
        if row in ISOLATED or row in isolate:
            groups.setdefault(ISOLATED.get(row, ""), []).append(row)
    return groups


def child_argv(shape: str, rows: list[str], args, checkpoint: Path, out: Path) -> list[str]:
    """This script's arguments for a child running ``rows`` of ``shape`` under this run's protocol."""
    argv = ["--shape", shape, "--rows", *rows, "--checkpointing", args.checkpointing]
    argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--no-ops"]
    argv += ["--checkpoint-dir", str(checkpoint), "--child-json", str(out), "--out-dir", str(out.parent)]
    return argv + ["--liger"] * args.liger + ["--tiny"] * args.tiny


def run_child(
    shape: str, rows: list[str], first: str, args, checkpoint: Path, modes: list[bool]
) -> list[dict]:
    """Runs ``rows`` in a fresh process of this script (importing ``first`` before anything else) and returns
    the rows it wrote as JSON; rows of a child that died without writing them come back failed."""
    with tempfile.TemporaryDirectory(prefix="bench-child-") as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-c", CHILD_BOOT, str(Path(__file__).resolve())]
        env = os.environ | CHILD_ENV | {"LORALEI_BENCH_PREIMPORT": first}
        proc = subprocess.run([*cmd, *child_argv(shape, rows, args, checkpoint, out)], env=env, check=False)
        if out.exists():
            return json.loads(out.read_text())
    error = f"child process exited with code {proc.returncode} without results"
    return [failed_row(shape, row, ckpt, args.liger, error) for ckpt in modes for row in rows]


def run_shape(shape: str, modes: list[bool], args, device, dtype, scratch: Path) -> list[dict]:
    """Every row of one shape, in the order (checkpointing, row): in-process rows first, then each child."""
    groups = child_groups(args)
    isolated = {row for rows in groups.values() for row in rows}
    checkpoint = args.checkpoint_dir or scratch / shape
    # every row loads its model from there, as its users do; tokenizer.json is written last: a save cut short is
    # redone rather than half read
    if not (checkpoint / "tokenizer.json").exists():
        save_checkpoint(shape, checkpoint, device, dtype)
    steps = [
        guarded_row(shape, row, ckpt, args, device, dtype, checkpoint)
        for ckpt in modes
        for row in args.rows
        if row not in isolated
    ]
    for first, rows in groups.items():
        steps += run_child(shape, rows, first, args, checkpoint, modes)
    order = [(ckpt, row) for ckpt in modes for row in args.rows]
    return sorted(steps, key=lambda r: order.index((r["checkpointing"], r["row"].removesuffix("+liger"))))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_rows_interleaved(shape: str, rows: list[str], checkpointing: bool, args, device, dtype) -> list[dict]:
    """All rows' models resident at once; their steps alternate in turns of ``--steps-per-turn`` steps for
    ``--rounds`` rounds, and each row reports its median turn. Clock drift under sustained load then affects every
    row alike. A row's peak is the allocator's peak during its turns less what the other rows hold. All rows'
    models must fit at once (for the 8B shape: the PEFT bf16 and loralei rows, not the FP32-adapter one)."""
    ids = batch_ids(shape, device)
    models = {row: prepared_model(shape, row, args.liger, checkpointing, device, dtype) for row in rows}
    opts = {row: adamw(m, device) for row, m in models.items()}

    def turn(row: str, steps: int) -> float:
        sync(device)
        start = time.perf_counter()
        train_steps(models[row], opts[row], ids, steps, row_loss(row))
        sync(device)
        return (time.perf_counter() - start) / steps

    def own_bytes(row: str) -> int:
        state = [t for st in opts[row].state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        return _bytes(models[row].parameters()) + _bytes(models[row].buffers()) + _bytes(state)

    for row in rows:
        turn(row, args.warmup)
    seconds: dict[str, list[float]] = {row: [] for row in rows}
    peaks: dict[str, float | None] = dict.fromkeys(rows, 0.0 if device.type == "cuda" else None)
    for _ in range(args.rounds):
        for row in rows:
            if device.type == "cuda":
                others = torch.cuda.memory_allocated() - own_bytes(row)
                torch.cuda.reset_peak_memory_stats()
            seconds[row].append(turn(row, args.steps_per_turn))
            if device.type == "cuda":
                peaks[row] = max(peaks[row], (torch.cuda.max_memory_allocated() - others) / 2**30)
    models.clear()
    opts.clear()
    release(device)
    return [
        row_result(shape, row, checkpointing, args.liger, statistics.median(seconds[row]), peaks[row])
        for row in rows
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["llama3-8b"], choices=sorted(SHAPES))
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=ROWS)
    parser.add_argument(
        "--isolate",
        nargs="+",
        default=[],
        choices=ROWS,
        help="also run these rows in a child process (Unsloth rows always are)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="saved random-weight model of the (one) shape for the checkpoint-loading rows (default: saved "
        "into a temporary directory when a row needs it)",
    )
    parser.add_argument("--child-json", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", choices=["off", "on", "both"], default="both")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--op-reps", type=int, default=10)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="keep every row's model resident and alternate their steps (median per row; see run_rows_interleaved)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="with --interleave: turns per row")
    parser.add_argument("--steps-per-turn", type=int, default=2, help="with --interleave: steps per turn")
    parser.add_argument("--liger", action="store_true", help="apply Liger kernels to every row")
    parser.add_argument("--no-ops", action="store_true", help="skip the op microbenchmarks")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="CPU smoke run, fp32, 1 step, on the tiny shapes given (tiny-moe) or else on tiny",
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--tag", default=None, help="file name stem of the results (default: date and shapes)"
    )
    args = parser.parse_args(argv)
    if args.checkpoint_dir is not None and len(args.shape) > 1:
        parser.error("--checkpoint-dir holds one shape's model: give one --shape")
    if args.interleave and liger_apart(args):
        parser.error(
            "--interleave with --liger cannot mix loralei's fused rows with others (see liger_apart)"
        )
    if args.interleave and {*args.rows} & {*ISOLATED, *args.isolate, *FROM_CHECKPOINT}:
        parser.error(
            "--interleave runs in-process rows that build their model: not " + ", ".join(FROM_CHECKPOINT)
        )
    if args.tiny:
        args.shape = [s for s in args.shape if s in TINY_SHAPES] or ["tiny"]
        args.steps, args.warmup, args.op_reps, args.rounds = 1, 1, 1, 2
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    if args.interleave:
        steps = [
            r
            for s in args.shape
            for ckpt in modes
            for r in run_rows_interleaved(s, args.rows, ckpt, args, device, dtype)
        ]
    else:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as scratch:
            steps = [r for s in args.shape for r in run_shape(s, modes, args, device, dtype, Path(scratch))]
    if args.child_json is not None:  # a child: its parent merges these rows into its table
        args.child_json.write_text(json.dumps(steps))
        return {"env": {}, "steps": steps, "ops": []}
    add_ratios(steps)
    ops = [] if args.no_ops else [m for s in args.shape for m in micro(s, args, device, dtype)]
    env = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "dtype": str(dtype).removeprefix("torch."),
    }
    env |= installed_versions()
    results = {"env": env, "steps": steps, "ops": ops}
    write_results(results, args.out_dir, args.tag or f"{env['date']}-{'-'.join(args.shape)}")
    return results


if __name__ == "__main__":
    failed = [r["row"] for r in main()["steps"] if "error" in r]
    if failed:
        print("failed rows: " + ", ".join(failed), file=sys.stderr)
    sys.exit(1 if failed and "--child-json" not in sys.argv else 0)
