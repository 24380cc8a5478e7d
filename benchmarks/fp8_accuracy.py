"""What an FP8 base costs in accuracy, at model level: logits against the bf16 base, and a short real run.

1. Logits: the shape's random-weight model (seeded) runs one batch in FP32, then in bf16; then its adapted
   projections are packed to FP8 (``quantization_type="fp8"``, the default FP8 GEMMs: the forward with fast
   accumulation) and the batch runs again, and once more with ``fp8_fast_accum=False`` (FP32 accumulation).
   Reported: the norm-wise relative error of the FP8 logits against the bf16 ones, and of both against FP32
   (what bf16 itself costs), the same for FP32 accumulation, and the two FP8 runs against each other (what fast
   accumulation alone costs), for the full depth and for the first ``--shallow`` layers. A random-weight model
   this deep is chaotic (bf16 alone moves its logits by about their own norm), so the shallow model is where
   the FP8 error can be read.
2. Training: the quickstart (its tiny model and data, the runner with its defaults) for ``--steps`` steps in
   bf16, on the bf16 base and on an FP8 base, for each of ``--seeds`` seeds (``--jobs`` runs at a time), trained
   on 90 % of its rows: the final training loss (the mean of the last logging window) and the loss on the other
   10 % after the last step; for each, the relative difference of the bases' means and the seed-to-seed spread it
   is to be read against (each base's relative s.d., the mean and standard error of the same-seed ratios).

    python benchmarks/fp8_accuracy.py --seeds 16 --jobs 8 --out fp8-accuracy.json   # on an FP8 GPU
    python benchmarks/fp8_accuracy.py --shape tiny --steps 5 --emulated  # the same code on the CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import rel_err
from bench_rows import SHAPES, build_model

from loralei import LoRAConfig, inject_lora
from loralei.train.loading import load_config
from loralei.train.metrics import read_log
from loralei.train.run import train

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = 10  # percent of the quickstart's rows kept out of training, for the final evaluation
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@torch.no_grad()
def logits_errors(
    shape: str, tokens: int, device: torch.device, kernel: str, layers: int | None = None
) -> dict[str, float]:
    """Relative errors of the bf16 and FP8-base logits of one batch, against FP32 and each other."""
    model = build_model(shape, device, torch.float32, layers=layers).eval()
    ids = torch.randint(0, SHAPES[shape][1]["vocab_size"], (1, tokens), device=device)
    fp32 = model(input_ids=ids).logits.float().cpu()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to(torch.bfloat16)
    for name, b in buffers.items():  # RoPE's inv_freq stays FP32, as in a model built in bf16
        module, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module), attr, b)
    bf16 = model(input_ids=ids).logits.float().cpu()
    fp8 = {}
    # the default (fast accumulation) last: it is injected into the model itself, the other into a copy
    for fast, name in ((False, "fp8_fp32_accum"), (True, "fp8")):
        config = LoRAConfig(
            r=16,
            target_modules=TARGETS,
            quantize_base=True,
            quantization_type="fp8",
            fp8_kernel=kernel,
            fp8_fast_accum=fast,
        )
        adapted = inject_lora(model if fast else copy.deepcopy(model), config)
        fp8[name] = adapted(input_ids=ids).logits.float().cpu()
        del adapted
    return {
        "fp8_vs_bf16": rel_err(fp8["fp8"], bf16),
        "fp8_vs_fp32": rel_err(fp8["fp8"], fp32),
        "fp8_fp32_accum_vs_bf16": rel_err(fp8["fp8_fp32_accum"], bf16),
        "fp8_vs_fp8_fp32_accum": rel_err(fp8["fp8"], fp8["fp8_fp32_accum"]),
        "bf16_vs_fp32": rel_err(bf16, fp32),
    }


def quickstart_loss(steps: int, fp8_kernel: str | None, seed: int, workdir: Path) -> dict[str, float]:
    """The quickstart in bf16 on a bf16 base or (``fp8_kernel`` set) an FP8 one, trained on the first 90 % of its
    rows: the first and last logged training loss, and the loss on the other 10 % after the last step."""
    out = workdir / ((fp8_kernel or "bf16") + f"-{seed}")
    overrides = [
        f"training.seed={seed}",
        "model.dtype=bfloat16",
        f"training.max_steps={steps}",
        f"training.logging_steps={max(1, min(50, steps // 6))}",
        f"training.save_steps={steps}",
        f"optimizer.warmup_steps={min(30, steps // 2)}",
        f"data.split=train[:{100 - HELD_OUT}%]",
        f"data.eval_split=train[{100 - HELD_OUT}%:]",
        f"output_dir={out}",
    ]
    if fp8_kernel is not None:
        overrides += [
            "lora.quantize_base=true",
            "lora.quantization_type=fp8",
            f"lora.fp8_kernel={fp8_kernel}",
        ]
    result = train(load_config(str(REPO / "examples" / "quickstart.yaml"), overrides))
    assert result is not None
    evals = [r["eval_loss"] for r in read_log(out) if "eval_loss" in r]
    return {"first_loss": result.first_loss, "last_loss": result.last_loss, "eval_loss": evals[-1]}


def _run(job: tuple[int, str | None, int, Path]) -> dict[str, float]:
    return quickstart_loss(*job)


def quickstart_runs(steps: int, seeds: int, kernel: str, jobs: int) -> dict[str, list[dict[str, float]]]:
    """Every seed's run on each base, ``jobs`` processes at a time (the tiny model leaves the GPU mostly idle:
    one process keeps it busy a fraction of the time)."""
    bases = (("bf16", None), ("fp8", kernel))
    with tempfile.TemporaryDirectory() as tmp:
        todo = [(steps, k, seed, Path(tmp)) for _, k in bases for seed in range(seeds)]
        if jobs > 1:
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(jobs, mp_context=context) as pool:
                done = list(pool.map(_run, todo))
        else:
            done = [_run(job) for job in todo]
    return {name: done[i * seeds : (i + 1) * seeds] for i, (name, _) in enumerate(bases)}


def seed_spread(runs: dict[str, list[dict[str, float]]], key: str = "last_loss") -> dict[str, float]:
    """How much the loss ``key`` moves with the seed, against which the two bases' difference is read: each
    base's relative standard deviation, and the mean and standard error of the same-seed ratios ``fp8 / bf16 - 1``
    (empty for a single seed)."""
    if len(runs["bf16"]) < 2:
        return {}
    last = {name: [r[key] for r in rs] for name, rs in runs.items()}
    paired = [f / b - 1 for f, b in zip(last["fp8"], last["bf16"], strict=True)]
    return {
        **{f"{name}_rel_sd": statistics.stdev(v) / statistics.mean(v) for name, v in last.items()},
        "paired_mean": statistics.mean(paired),
        "paired_se": statistics.stdev(paired) / len(paired) ** 0.5,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the logits batch")
    parser.add_argument("--shallow", type=int, default=2, help="decoder layers of the shallow logits model")
    parser.add_argument("--steps", type=int, default=300, help="quickstart steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="quickstart runs per base (seeds 0, 1, ...)")
    parser.add_argument("--jobs", type=int, default=1, help="quickstart runs at a time, each its own process")
    parser.add_argument("--emulated", action="store_true", help="fp8_kernel='emulated' (any device)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel = "emulated" if args.emulated else "auto"
    logits = {}
    for depth, layers in (("full", None), ("shallow", args.shallow)):
        logits[depth] = logits_errors(args.shape, args.tokens, device, kernel, layers)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    runs = quickstart_runs(args.steps, args.seeds, kernel, args.jobs)
    metrics = ("last_loss", "eval_loss")
    means = {m: {name: statistics.mean(r[m] for r in rs) for name, rs in runs.items()} for m in metrics}
    drift = {m: abs(means[m]["fp8"] - means[m]["bf16"]) / means[m]["bf16"] for m in metrics}
    result = {
        "shape": args.shape,
        "fp8_kernel": kernel,
        "logits": logits,
        "quickstart": runs,
        "held_out_percent": HELD_OUT,
        "means": means,
        "rel_diff": drift,
        "seed_spread": {m: seed_spread(runs, m) for m in metrics},
    }
    for depth, errs in logits.items():
        print(
            f"logits ({args.shape}, {depth} depth, {args.tokens} tokens): "
            + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
        )
    for name, rs in runs.items():
        losses = ", ".join(
            f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} ({r['eval_loss']:.3f})" for r in rs
        )
        print(
            f"quickstart {name}, seeds 0-{args.seeds - 1}, training loss first -> last (held-out): {losses}"
        )
    for m in metrics:
        spread = result["seed_spread"][m]
        line = f"{m}: bf16 {means[m]['bf16']:.4f}, FP8 {means[m]['fp8']:.4f}, means {drift[m]:.2%} apart"
        if spread:
            line += (
                f"; seed to seed s.d. {spread['bf16_rel_sd']:.1%} (bf16), {spread['fp8_rel_sd']:.1%} (FP8); "
                f"same-seed FP8/bf16 - 1: mean {spread['paired_mean']:+.1%}, standard error {spread['paired_se']:.1%}"
            )
        print(line)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
