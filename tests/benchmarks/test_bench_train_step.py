"""The train-step benchmark's --tiny CPU mode runs end to end and writes its JSON and markdown results; the
QLoRA rows' plumbing (row choices, child processes, merged tables, saved checkpoints) works without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train_step.py"


def _load_bench():
    """The benchmark script as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_train_step", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _load_rows():
    """The script's shapes and rows module (importable once the script has put its folder on sys.path)."""
    _load_bench()
    return importlib.import_module("bench_rows")


def test_tiny_mode_writes_results(tmp_path: Path) -> None:
    bench = _load_bench()
    argv = ["--tiny", "--rows", "peft-bf16-adapters", "loralei-fused", "--checkpointing", "on"]
    results = bench.main([*argv, "--out-dir", str(tmp_path), "--tag", "smoke"])
    assert [r["row"] for r in results["steps"]] == ["peft-bf16-adapters", "loralei-fused"]
    assert all(r["tokens_per_s"] > 0 for r in results["steps"]) and results["steps"][0]["ratio"] == 1.0
    assert {m["op"] for m in results["ops"]} == {
        "o_proj (lora_w)",
        "down_proj (lora_w)",
        "q/k/v (lora_group)",
        "gated MLP (lora_mlp)",
    }
    assert json.loads((tmp_path / "smoke.json").read_text()) == results
    assert "| tiny | loralei-fused | True |" in (tmp_path / "smoke.md").read_text()


def test_interleaved_mode_reports_every_row(tmp_path: Path) -> None:
    """--interleave keeps the rows' models resident and alternates their steps; rows come back in order."""
    bench = _load_bench()
    argv = ["--tiny", "--interleave", "--no-ops", "--rows", "peft-bf16-adapters", "loralei-fused"]
    results = bench.main([*argv, "--out-dir", str(tmp_path), "--tag", "il"])
    rows = [(r["row"], r["checkpointing"]) for r in results["steps"]]
    assert rows == [(row, ckpt) for ckpt in (False, True) for row in ("peft-bf16-adapters", "loralei-fused")]
    assert all(r["tokens_per_s"] > 0 for r in results["steps"])


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_qlora_rows_are_choices_and_defaults_unchanged() -> None:
    bench = _load_bench()
    args = bench.parse_args(["--tiny"])
    assert args.rows == list(bench.DEFAULT_ROWS)
    qlora = [
        "peft-bnb-nf4",
        "unsloth-bf16",
        "unsloth-4bit",
        "loralei-nf4",
        "loralei-nf4-triton",
        "loralei-int4",
    ]
    assert bench.parse_args(["--tiny", "--rows", *qlora]).rows == qlora


def test_unsloth_rows_go_to_one_child_and_isolate_adds_rows() -> None:
    """Unsloth rows share a child that imports unsloth first; --isolate rows share one that imports nothing;
    a child itself runs everything in-process."""
    bench = _load_bench()
    rows = ["peft-bf16-adapters", "unsloth-4bit", "loralei-fused", "unsloth-bf16"]
    args = bench.parse_args(["--tiny", "--rows", *rows, "--isolate", "loralei-fused"])
    assert bench.child_groups(args) == {"unsloth": ["unsloth-4bit", "unsloth-bf16"], "": ["loralei-fused"]}
    child = bench.parse_args(["--tiny", "--rows", *rows, "--child-json", "x.json"])
    assert bench.child_groups(child) == {}


def test_with_liger_loralei_fused_rows_run_apart_from_rows_that_take_liger_swiglu() -> None:
    """Liger swaps the MLP class globally for the other rows, which would unfuse a later loralei model's MLP."""
    bench = _load_bench()
    rows = ["peft-bf16-adapters", "loralei-nf4", "loralei-fused"]
    liger = bench.parse_args(["--tiny", "--liger", "--rows", *rows])
    assert bench.child_groups(liger) == {"": ["loralei-nf4", "loralei-fused"]}
    assert bench.child_groups(bench.parse_args(["--tiny", "--rows", *rows])) == {}
    alone = bench.parse_args(["--tiny", "--liger", "--rows", "loralei-nf4", "loralei-fused"])
    assert bench.child_groups(alone) == {}
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--liger", "--interleave", "--rows", *rows])


def test_child_argv_keeps_the_protocol(tmp_path: Path) -> None:
    bench = _load_bench()
    args = bench.parse_args(["--shape", "llama3-8b", "--steps", "5", "--warmup", "2", "--liger"])
    argv = bench.child_argv("llama3-8b", ["unsloth-4bit"], args, tmp_path / "ckpt", tmp_path / "rows.json")
    child = bench.parse_args(argv)
    assert (child.shape, child.rows, child.steps, child.warmup) == (["llama3-8b"], ["unsloth-4bit"], 5, 2)
    assert child.liger and child.no_ops and child.checkpointing == "both"
    assert child.child_json == tmp_path / "rows.json" and child.checkpoint_dir == tmp_path / "ckpt"


def test_interleave_refuses_child_and_checkpoint_rows() -> None:
    bench = _load_bench()
    for row in ("unsloth-4bit", "peft-bnb-nf4"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--tiny", "--interleave", "--rows", "peft-bf16-adapters", row])


def test_isolated_row_runs_in_a_child_and_merges_into_the_table(tmp_path: Path) -> None:
    """An ordinary row forced into a child comes back in the table, in row order, with its ratio."""
    bench = _load_bench()
    rows = ["peft-bf16-adapters", "loralei-fused", "loralei-unfused"]
    argv = ["--tiny", "--no-ops", "--rows", *rows, "--isolate", "loralei-fused", "--checkpointing", "both"]
    results = bench.main([*argv, "--out-dir", str(tmp_path), "--tag", "child"])
    assert [(r["row"], r["checkpointing"]) for r in results["steps"]] == [
        (row, ckpt) for ckpt in (False, True) for row in rows
    ]
    assert all(r["tokens_per_s"] > 0 and "ratio" in r for r in results["steps"])
    assert "| tiny | loralei-fused | True |" in (tmp_path / "child.md").read_text()


def test_dead_child_rows_come_back_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that dies before writing its JSON (a crash, an import error) leaves failed rows, not a hole."""
    bench = _load_bench()
    monkeypatch.setattr(bench, "CHILD_BOOT", "import sys; sys.exit(3)")
    args = bench.parse_args(["--tiny", "--rows", "loralei-fused", "--isolate", "loralei-fused"])
    rows = bench.run_child("tiny", ["loralei-fused"], "", args, tmp_path, [False, True])
    assert [r["checkpointing"] for r in rows] == [False, True]
    assert all(r["tokens_per_s"] is None and "code 3" in r["error"] for r in rows)
    bench.add_ratios(rows)
    assert "failed: child process exited with code 3" in bench.failure_cell(rows[0]["error"])


def test_child_env_is_offline_and_imports_first(tmp_path: Path) -> None:
    """The child boot imports LORALEI_BENCH_PREIMPORT before running the script, under the offline variables."""
    bench = _load_bench()
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "keys = ['HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE', 'HF_DATASETS_OFFLINE', 'UNSLOTH_DISABLE_STATISTICS']\n"
        "out = {'first': 'colorsys' in sys.modules, 'env': [os.environ.get(k) for k in keys], 'argv': sys.argv}\n"
        "print(json.dumps(out))\n"
    )
    env = os.environ | bench.CHILD_ENV | {"LORALEI_BENCH_PREIMPORT": "colorsys"}
    cmd = [sys.executable, "-c", bench.CHILD_BOOT, str(probe), "--x"]
    out = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
    assert out == {"first": True, "env": ["1"] * 4, "argv": [str(probe), "--x"]}


def test_loralei_nf4_rows_quantize_with_blocks_that_fit_the_shape() -> None:
    rows = _load_rows()
    assert rows.loralei_config("loralei-nf4", "llama3-8b").nf4_block_size == 64
    tiny = rows.loralei_config("loralei-nf4-triton", "tiny")
    assert tiny.quantize_base and tiny.nf4_kernel == "triton" and tiny.nf4_scaler_block_size == 2
    assert not rows.loralei_config("loralei-fused", "tiny").quantize_base


def test_saved_checkpoint_holds_build_model_weights_and_a_vocab_tokenizer(tmp_path: Path) -> None:
    rows = _load_rows()
    cpu = torch.device("cpu")
    rows.save_checkpoint("tiny", tmp_path, cpu, torch.float32)
    built = rows.build_model("tiny", cpu, torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert all(torch.equal(built[k], loaded[k]) for k in built)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == rows.SHAPES["tiny"][1]["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert tok("t5 t255")["input_ids"][-2:] == [5, 255]


@pytest.mark.skipif(not _has("bitsandbytes"), reason="needs bitsandbytes")
def test_bnb_nf4_row_quantizes_the_target_projections(tmp_path: Path) -> None:
    rows = _load_rows()
    import bitsandbytes as bnb

    cpu = torch.device("cpu")
    rows.save_checkpoint("tiny", tmp_path, cpu, torch.float32)
    model = rows.load_bnb_nf4(tmp_path, cpu, torch.float32)
    quantized = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized == set(rows.TARGETS)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.quant_type == "nf4" and layer.weight.compress_statistics
    assert not isinstance(model.lm_head, bnb.nn.Linear4bit)


@pytest.mark.gpu
@pytest.mark.skipif(not (_has("unsloth") and torch.cuda.is_available()), reason="needs unsloth and CUDA")
def test_unsloth_rows_run(tmp_path: Path) -> None:
    bench = _load_bench()
    argv = ["--shape", "tiny", "--steps", "1", "--warmup", "1", "--no-ops", "--checkpointing", "on"]
    results = bench.main([*argv, "--rows", "peft-bf16-adapters", "unsloth-4bit", "--out-dir", str(tmp_path)])
    assert all("error" not in r for r in results["steps"])
