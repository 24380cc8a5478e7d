"""Does quantization-aware LoRA (``lora.qat``) keep more of what the adapter learned once the merged model is
quantized? Trains a runner config with and without QAT for several seeds, merges each adapter, rounds the merged
model's adapted weights to the target format, and reports the held-out loss (mean cross entropy of the answer
tokens) and exact-match accuracy (greedy answers) of:

- the dense merged model (no QAT),
- the quantized merged model, trained without QAT,
- the quantized merged model, trained with QAT for that format (and its dense merged model, for reference).

CPU, no downloads: e.g. ``python benchmarks/qat_measure.py examples/quickstart.yaml --seeds 0 1 2``. Runs go two
at a time, one thread each; each writes its output under ``--work``; the rows go to ``--out`` (JSON).
``--widen hidden_size=128 intermediate_size=384 num_hidden_layers=4`` trains a larger random model instead: the
config's model with those settings, initialised as ``examples/quickstart/make_assets.py`` initialises its own.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
# Per format, the qat settings used (group sizes that divide the quickstart model's widths 64, 128 and 192).
FORMATS: dict[str, dict[str, Any]] = {
    "int4": {"weight": "int4", "group_size": 64},
    "nf4": {"weight": "nf4", "group_size": 64, "scaler_block_size": 8},
    "fp8": {"weight": "fp8"},
    "nvfp4": {"weight": "nvfp4"},
}


def _widened(model_dir: Path, settings: list[str], out: Path) -> Path:
    """A random-weight model like ``model_dir``'s with ``settings`` (``name=int``) changed, saved with its
    tokenizer under ``out``, initialised as the quickstart assets are (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.spec_from_file_location("make_assets", ROOT / "examples/quickstart/make_assets.py")
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    config = AutoConfig.from_pretrained(model_dir)
    for item in settings:
        name, value = item.split("=")
        setattr(config, name, int(value))
    config.layer_types = config.layer_types[:1] * config.num_hidden_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=assets.EMBEDDING_STD)
    for layer in model.model.layers:
        torch.nn.init.constant_(layer.self_attn.q_norm.weight, assets.QK_NORM_WEIGHT)
        torch.nn.init.constant_(layer.self_attn.k_norm.weight, assets.QK_NORM_WEIGHT)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _qat(fmt: str | None, start_step: int) -> dict | None:
    """The ``lora.qat`` section of a run in ``fmt`` (None: the plain run)."""
    if fmt is None:
        return None
    return FORMATS[fmt] | ({"start_step": start_step} if start_step else {})


def _run_config(base: dict[str, Any], out: Path, seed: int, steps: int | None, qat: dict | None) -> Path:
    """A copy of the runner config with this run's seed, output dir, steps and qat, written next to ``out``."""
    cfg = json.loads(json.dumps(base))
    cfg["output_dir"] = str(out)
    cfg["training"]["seed"] = seed
    if steps is not None:
        cfg["training"]["max_steps"] = steps
        cfg["training"]["save_steps"] = steps
    cfg["lora"] = {k: v for k, v in cfg["lora"].items() if k != "qat"}
    if qat is not None:
        cfg["lora"]["qat"] = qat
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path) -> None:
    """One runner process with one thread (two run side by side); a finished run is kept, not run again."""
    if (config.with_suffix("") / "run_summary.json").is_file():
        return
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}",
    }
    log = config.with_suffix(".log")
    with log.open("w") as f:
        subprocess.run(
            [sys.executable, "-m", "loralei.cli", str(config)],
            check=True,
            env=env,
            stdout=f,
            stderr=f,
            cwd=ROOT,
        )


def _heldout(path: Path) -> list[tuple[list[dict], str]]:
    """(prompt turns, expected answer) of each held-out chat row."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["messages"][:-1], r["messages"][-1]["content"]) for r in rows]


@torch.no_grad()
def _evaluate(model: torch.nn.Module, tokenizer: Any, rows: list[tuple[list[dict], str]]) -> dict[str, float]:
    """Mean cross entropy of the answer tokens through the end-of-turn token (what the runner trains; the
    template's newline after it is not trained) and the greedy exact-match rate."""
    from loralei.generate import answer

    total, tokens, right = 0.0, 0, 0
    for turns, expected in rows:
        prompt = tokenizer.apply_chat_template(
            turns, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        full = tokenizer.apply_chat_template(
            [*turns, {"role": "assistant", "content": expected}], tokenize=True, return_dict=True
        )
        n = len(prompt["input_ids"])
        end = full["input_ids"].index(tokenizer.eos_token_id, n) + 1
        ids = torch.tensor([full["input_ids"][:end]])
        logits = model(input_ids=ids).logits[0, n - 1 : -1].float()
        target = ids[0, n:]
        total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
        tokens += target.numel()
        right += answer(model, tokenizer, turns, max_new_tokens=12) == expected
    return {"loss": total / tokens, "accuracy": right / len(rows)}


def _scores(model_dir: str, adapter: Path, rows: list, formats: list[str]) -> dict[str, dict[str, float]]:
    """Held-out scores of the merged model, dense and rounded to each format."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loralei import load_pretrained, merge_and_unload_lora
    from loralei.config import QATConfig
    from loralei.inject import lora_modules
    from loralei.modules.quantized.fake_quant import fake_quantize_linears_

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = {}
    for fmt in [None, *formats]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        load_pretrained(model, adapter)
        names = [name for name, _ in lora_modules(model)]
        merge_and_unload_lora(model)
        if fmt is not None:
            fake_quantize_linears_([(n, model.get_submodule(n)) for n in names], QATConfig(**FORMATS[fmt]))
        out[fmt or "dense"] = _evaluate(model, tokenizer, rows)
    return out


def _summary(rows: list[dict[str, Any]], formats: list[str]) -> list[dict[str, Any]]:
    """Per format: mean and spread over seeds of each model's held-out loss and accuracy."""
    table = []
    for fmt in formats:
        cells = {
            "dense merged, no QAT": [r["plain"]["dense"] for r in rows],
            f"{fmt} merged, no QAT": [r["plain"][fmt] for r in rows],
            f"{fmt} merged, QAT": [r["qat"][fmt][fmt] for r in rows],
            "dense merged, QAT": [r["qat"][fmt]["dense"] for r in rows],
        }
        for label, values in cells.items():
            losses = [v["loss"] for v in values]
            table.append(
                {
                    "format": fmt,
                    "model": label,
                    "loss_mean": statistics.mean(losses),
                    "loss_stdev": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                    "losses": losses,
                    "accuracy_mean": statistics.mean(v["accuracy"] for v in values),
                }
            )
    return table


def _markdown(result: dict[str, Any]) -> str:
    """The summary as a markdown table, with the setup line."""
    head = (
        f"# lora.qat measurement ({result['date']}, {result['commit']})\n\n"
        f"`{result['command']}`: {result['config']}, {result['max_steps']} steps, seeds {result['seeds']}, "
        f"widen {result['widen'] or 'no'}; torch {result['torch']}, CPU. Held-out loss: mean cross entropy of "
        "the answer tokens through the end of turn; accuracy: greedy exact match.\n\n"
        "| format | model | held-out loss (mean ± sd) | per seed | accuracy |\n|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['format']} | {r['model']} | {r['loss_mean']:.4f} ± {r['loss_stdev']:.4f} | "
        f"{', '.join(f'{v:.4f}' for v in r['losses'])} | {r['accuracy_mean']:.3f} |"
        for r in result["summary"]
    ]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="runner YAML (its data, model and LoRA settings)")
    p.add_argument("--heldout", type=Path, default=ROOT / "examples/quickstart/heldout.jsonl")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--formats", nargs="+", default=["int4", "nf4"], choices=sorted(FORMATS))
    p.add_argument("--max-steps", type=int, default=None, help="override training.max_steps")
    p.add_argument(
        "--widen", nargs="+", default=[], metavar="NAME=INT", help="train a larger model (see above)"
    )
    p.add_argument(
        "--qat-start-step", type=int, default=0, help="lora.qat.start_step of the QAT runs (default 0)"
    )
    p.add_argument("--work", type=Path, default=Path("outputs/qat_measure"))
    p.add_argument("--out", type=Path, default=Path("outputs/qat_measure/results.json"))
    args = p.parse_args(argv)
    base = yaml.safe_load(args.config.read_text())
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.widen:
        wide = _widened(ROOT / base["model"]["name_or_path"], args.widen, args.work / "model")
        base["model"]["name_or_path"] = str(wide)
    runs = {(s, f): args.work / f"seed{s}-{f or 'plain'}" for s in args.seeds for f in [None, *args.formats]}
    configs = [
        _run_config(base, out, s, args.max_steps, _qat(f, args.qat_start_step))
        for (s, f), out in runs.items()
    ]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(_train, configs))
    torch.set_num_threads(2)
    model_dir = str(ROOT / base["model"]["name_or_path"])
    held = _heldout(args.heldout)
    rows = []
    for s in args.seeds:
        row = {
            "seed": s,
            "plain": _scores(model_dir, runs[(s, None)] / "adapter", held, args.formats),
            "qat": {},
        }
        for f in args.formats:
            row["qat"][f] = _scores(model_dir, runs[(s, f)] / "adapter", held, [f])
        rows.append(row)
        print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "command": " ".join(
            ["python benchmarks/qat_measure.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "seeds": args.seeds,
        "config": str(args.config),
        "widen": args.widen,
        "max_steps": args.max_steps or base["training"]["max_steps"],
        "qat_start_step": args.qat_start_step,
        "formats": {f: FORMATS[f] for f in args.formats},
        "torch": torch.__version__,
        "rows": rows,
        "summary": _summary(rows, args.formats),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(_markdown(result))
    for line in result["summary"]:
        print(
            f"{line['format']:6} {line['model']:24} loss {line['loss_mean']:.4f} ± {line['loss_stdev']:.4f}"
            f"  accuracy {line['accuracy_mean']:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
