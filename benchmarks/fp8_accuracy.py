"""What an FP8 base costs in accuracy, at model level: logits against the bf16 base, and a short real run.

1. Logits: the shape's random-weight model (seeded) runs one batch in FP32, then in bf16; then its adapted
   projections are packed to FP8 (``quantization_type="fp8"``, the default FP8 GEMMs) and the batch runs again.
   Reported: the norm-wise relative error of the FP8 logits against the bf16 ones, and of both against FP32
   (what bf16 itself costs), for the full depth and for the first ``--shallow`` layers. A random-weight model
   this deep is chaotic (bf16 alone moves its logits by about their own norm), so the shallow model is where
   the FP8 error can be read.
2. Training: the quickstart (its tiny model and data, the runner with its defaults) for ``--steps`` steps in
   bf16, on the bf16 base and on an FP8 base, for each of ``--seeds`` seeds; the final logged losses (each the
   mean of its last logging window), the relative difference of their means, and the seed-to-seed spread it is
   to be read against (each base's relative s.d., the mean and standard error of the same-seed ratios).

    python benchmarks/fp8_accuracy.py --out fp8-accuracy.json            # on an FP8 GPU
    python benchmarks/fp8_accuracy.py --shape tiny --steps 5 --emulated  # the same code on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import rel_err
from bench_rows import SHAPES, build_model

from loralei import LoRAConfig, inject_lora
from loralei.train.loading import load_config
from loralei.train.run import train

REPO = Path(__file__).resolve().parents[1]
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
    config = LoRAConfig(
        r=16, target_modules=TARGETS, quantize_base=True, quantization_type="fp8", fp8_kernel=kernel
    )
    fp8 = inject_lora(model, config)(input_ids=ids).logits.float().cpu()
    return {
        "fp8_vs_bf16": rel_err(fp8, bf16),
        "fp8_vs_fp32": rel_err(fp8, fp32),
        "bf16_vs_fp32": rel_err(bf16, fp32),
    }


def quickstart_loss(steps: int, fp8_kernel: str | None, seed: int, workdir: Path) -> dict[str, float]:
    """First and last logged loss of the quickstart in bf16, on a bf16 base or (``fp8_kernel`` set) an FP8 one."""
    overrides = [
        f"training.seed={seed}",
        "model.dtype=bfloat16",
        f"training.max_steps={steps}",
        f"training.logging_steps={max(1, min(50, steps // 6))}",
        f"training.save_steps={steps}",
        f"optimizer.warmup_steps={min(30, steps // 2)}",
        f"output_dir={workdir / ((fp8_kernel or 'bf16') + f'-{seed}')}",
    ]
    if fp8_kernel is not None:
        overrides += [
            "lora.quantize_base=true",
            "lora.quantization_type=fp8",
            f"lora.fp8_kernel={fp8_kernel}",
        ]
    result = train(load_config(str(REPO / "examples" / "quickstart.yaml"), overrides))
    assert result is not None
    return {"first_loss": result.first_loss, "last_loss": result.last_loss}


def seed_spread(runs: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """How much the final loss moves with the seed, against which the two bases' difference is read: each base's
    relative standard deviation, and the mean and standard error of the same-seed ratios ``fp8 / bf16 - 1``
    (empty for a single seed)."""
    if len(runs["bf16"]) < 2:
        return {}
    last = {name: [r["last_loss"] for r in rs] for name, rs in runs.items()}
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
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            name: [quickstart_loss(args.steps, k, seed, Path(tmp)) for seed in range(args.seeds)]
            for name, k in (("bf16", None), ("fp8", kernel))
        }
    means = {name: statistics.mean(r["last_loss"] for r in rs) for name, rs in runs.items()}
    drift = abs(means["fp8"] - means["bf16"]) / means["bf16"]
    result = {
        "shape": args.shape,
        "fp8_kernel": kernel,
        "logits": logits,
        "quickstart": runs,
        "mean_last_loss": means,
        "last_loss_rel_diff": drift,
        "seed_spread": seed_spread(runs),
    }
    for depth, errs in logits.items():
        print(
            f"logits ({args.shape}, {depth} depth, {args.tokens} tokens): "
            + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
        )
    for name, rs in runs.items():
        losses = ", ".join(f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}" for r in rs)
        print(f"quickstart {name} (seeds 0-{args.seeds - 1}): {losses}; mean final {means[name]:.4f}")
    print(f"mean final loss, FP8 base against bf16 base: {drift:.2%} apart")
    spread = result["seed_spread"]
    if spread:
        print(
            f"seed to seed: final loss s.d. {spread['bf16_rel_sd']:.1%} (bf16), {spread['fp8_rel_sd']:.1%} (FP8); "
            f"same-seed FP8/bf16 - 1: mean {spread['paired_mean']:+.1%}, standard error {spread['paired_se']:.1%}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
