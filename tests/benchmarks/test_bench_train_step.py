"""The train-step benchmark's --tiny CPU mode runs end to end and writes its JSON and markdown results; the
QLoRA rows' plumbing (row choices, child processes, merged tables, saved checkpoints) works without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import types
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
    # every row loads the shape's saved checkpoint, as its users load a model; no CUDA, no setup peak
    assert {(r["loaded_from"], r["setup_peak_gib"]) for r in results["steps"]} == {("disk", None)}


def test_rows_count_the_full_garbage_collections_inside_their_timed_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full collection walks every object of the process (hundreds of ms with a real model and its libraries):
    the row says how many fell into its timed steps, here one per step, forced (--tiny times one step)."""
    import gc

    bench = _load_bench()
    real = bench.train_steps

    def collecting(model, opt, ids, steps, loss=bench.model_loss) -> None:
        for _ in range(steps):
            real(model, opt, ids, 1, loss)
            gc.collect()

    monkeypatch.setattr(bench, "train_steps", collecting)
    argv = [
        "--tiny",
        "--rows",
        "peft-bf16-adapters",
        "--checkpointing",
        "off",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--no-ops",
    ]
    (row,) = bench.main([*argv, "--out-dir", str(tmp_path), "--tag", "gc"])["steps"]
    assert row["gc_full_collections"] == 1


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
        "unsloth-fp8",
        "unsloth-fp8-block",
        "loralei-nf4",
        "loralei-nf4-triton",
        "loralei-int4",
        "loralei-fp8",
    ]
    assert bench.parse_args(["--tiny", "--rows", *qlora]).rows == qlora


@pytest.mark.parametrize(
    ("row", "fp8", "four_bit"),
    [
        ("unsloth-bf16", False, False),
        ("unsloth-4bit", False, True),
        ("unsloth-fp8", True, False),
        ("unsloth-fp8-block", "block", False),
    ],
)
def test_unsloth_rows_load_the_checkpoint_with_their_precision(
    row: str, fp8: bool | str, four_bit: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each Unsloth row asks its loader for its own base precision (FP8: load_in_fp8, row-wise or "block"),
    from the saved checkpoint, in a child that imports unsloth first."""
    rows = _load_rows()
    calls: dict[str, dict] = {}

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            calls["load"] = kwargs
            return "model", "tokenizer"

        @staticmethod
        def get_peft_model(model, **kwargs):
            calls["peft"] = kwargs
            return model

        @staticmethod
        def for_training(model, **kwargs):
            calls["train"] = kwargs

    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=FastLanguageModel))
    assert rows.unsloth_model(row, "tiny", tmp_path, checkpointing=True) == "model"
    load = calls["load"]
    assert (load["load_in_fp8"], load["load_in_4bit"], load["model_name"]) == (fp8, four_bit, str(tmp_path))
    assert load["use_gradient_checkpointing"] == "unsloth" and calls["peft"]["r"] == 16
    assert rows.ISOLATED[row] == "unsloth" and row in rows.FROM_CHECKPOINT


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
    results = importlib.import_module("bench_results")
    results.add_ratios(rows)
    assert "failed: child process exited with code 3" in results.failure_cell(rows[0]["error"])


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


@pytest.mark.parametrize("shape", ["tiny", "tiny-moe"])
def test_saved_checkpoint_holds_build_model_weights_and_a_vocab_tokenizer(tmp_path: Path, shape: str) -> None:
    """Also for the MoE shape, whose packed expert banks Transformers saves expert by expert and packs again
    when loading."""
    rows = _load_rows()
    cpu = torch.device("cpu")
    rows.save_checkpoint(shape, tmp_path, cpu, torch.float32)
    built = rows.build_model(shape, cpu, torch.float32).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert built.keys() == loaded.keys() and all(torch.equal(built[k], loaded[k]) for k in built)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == rows.SHAPES[shape][1]["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert tok("t5 t255")["input_ids"][-2:] == [5, 255]


def test_moe_rows_and_shapes_are_choices() -> None:
    bench = _load_bench()
    rows = ["peft-bf16-adapters", "peft-eager-experts", "unsloth-bf16", "loralei-fused", "loralei-unfused"]
    args = bench.parse_args(["--shape", "qwen3-30b-a3b-8l", "--rows", *rows])
    assert args.shape == ["qwen3-30b-a3b-8l"] and args.rows == rows
    assert bench.parse_args(["--tiny", "--shape", "tiny-moe"]).shape == ["tiny-moe"]
    assert bench.parse_args(["--tiny", "--shape", "llama3-8b"]).shape == ["tiny"]


def test_moe_shape_matches_qwen3_30b_a3b_layers() -> None:
    rows = _load_rows()
    config_cls, cfg, batch, seq = rows.SHAPES["qwen3-30b-a3b-8l"]
    config = config_cls(**cfg)
    assert (config.hidden_size, config.head_dim, config.num_experts, config.num_experts_per_tok) == (
        2048,
        128,
        128,
        8,
    )
    assert (config.moe_intermediate_size, config.vocab_size, batch, seq) == (768, 151936, 4, 2048)
    assert config.norm_topk_prob and not config.tie_word_embeddings
    assert rows.is_moe("qwen3-30b-a3b-8l") and rows.moe_layers("qwen3-30b-a3b-8l") == 8
    assert not rows.is_moe("llama3-8b") and rows.moe_layers("llama3-8b") == 0


def _trainable(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    ("row", "experts"), [("peft-bf16-adapters", "grouped_mm"), ("peft-eager-experts", "eager")]
)
def test_peft_moe_rows_adapt_attention_and_expert_banks(row: str, experts: str) -> None:
    """PEFT's MoE rows put LoRA on q,k,v,o and, through target_parameters, on both expert banks of every layer;
    the eager row runs Transformers' expert-by-expert loop."""
    rows = _load_rows()
    model = rows.prepared_model("tiny-moe", row, False, False, torch.device("cpu"), torch.float32)
    names = _trainable(model)
    layers = rows.SHAPES["tiny-moe"][1]["num_hidden_layers"]
    for proj in rows.ATTENTION_TARGETS:
        assert sum(f"self_attn.{proj}.lora_A" in n for n in names) == layers
    # PEFT nests one ParamWrapper per targeted parameter: the outer one LoRAs down_proj, the inner gate_up_proj
    assert sum(n.endswith("mlp.experts.lora_A.default.weight") for n in names) == layers
    assert sum(n.endswith("mlp.experts.base_layer.lora_A.default.weight") for n in names) == layers
    assert not any("gate_proj" in n or "up_proj.lora" in n for n in names)
    assert model.config._experts_implementation == experts


def test_peft_eager_experts_row_needs_an_moe_shape() -> None:
    rows = _load_rows()
    with pytest.raises(ValueError, match="MoE shape"):
        rows.prepared_model("tiny", "peft-eager-experts", False, False, torch.device("cpu"), torch.float32)


def test_tiny_moe_peft_rows_run_end_to_end(tmp_path: Path) -> None:
    """The MoE shape's PEFT rows (expert banks through target_parameters) train on CPU; no op microbenchmarks."""
    bench = _load_bench()
    argv = ["--tiny", "--shape", "tiny-moe", "--rows", "peft-bf16-adapters", "peft-eager-experts"]
    results = bench.main([*argv, "--checkpointing", "both", "--out-dir", str(tmp_path), "--tag", "moe"])
    assert [(r["row"], r["checkpointing"]) for r in results["steps"]] == [
        (row, ckpt) for ckpt in (False, True) for row in ("peft-bf16-adapters", "peft-eager-experts")
    ]
    assert all(r["tokens_per_s"] > 0 and "ratio" in r for r in results["steps"]) and results["ops"] == []
    assert "| tiny-moe | peft-eager-experts | True |" in (tmp_path / "moe.md").read_text()


def _loralei_has_target_parameters() -> bool:
    from loralei import LoRAConfig

    return "target_parameters" in LoRAConfig.model_fields


@pytest.mark.skipif(not _loralei_has_target_parameters(), reason="LoRAConfig has no target_parameters yet")
def test_tiny_moe_loralei_rows_run_end_to_end(tmp_path: Path) -> None:
    """loralei's MoE rows: q,k,v,o and both expert banks adapted, unfused and fused, trained on CPU."""
    bench, rows = _load_bench(), _load_rows()
    config = rows.loralei_config("loralei-fused", "tiny-moe")
    assert config.target_parameters == ["experts.gate_up_proj", "experts.down_proj"]
    assert config.target_modules == rows.ATTENTION_TARGETS
    argv = [
        "--tiny",
        "--shape",
        "tiny-moe",
        "--rows",
        "peft-bf16-adapters",
        "loralei-unfused",
        "loralei-fused",
    ]
    results = bench.main([*argv, "--checkpointing", "on", "--out-dir", str(tmp_path), "--tag", "moe"])
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in results["steps"])


def run_gpu_calls(tmp_path: Path, *parts: str, env: dict[str, str] | None = None) -> list[list[str]]:
    """Runs run_gpu.sh's ``parts`` with python3 and nvidia-smi stubbed (and ``env`` added to the environment);
    returns the python3 calls, split."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    for tool in ("python3", "nvidia-smi"):
        # a line on stdout too: the script filters the bench's output through grep, which fails on none
        (bin_dir / tool).write_text(f'#!/usr/bin/env bash\necho "{tool} $*" | tee -a {log}\n')
        (bin_dir / tool).chmod(0o755)
    env = os.environ | (env or {}) | {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    cmd = ["bash", str(SCRIPT.parent / "run_gpu.sh"), str(tmp_path / "out"), *parts]
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    return [c.split() for c in log.read_text().splitlines() if c.startswith("python3")]


def test_run_gpu_moe_part_runs_the_protocol(tmp_path: Path) -> None:
    """run_gpu.sh parses, and its MoE parts run the issue's protocol: moe makes one bench call per checkpointing
    mode (off first) for PEFT and Unsloth, 2 warm-up and 5 timed steps, one shared saved checkpoint, a tag per mode;
    moe-liger runs loralei's rows with Liger, both modes, numbered per call (before and after moe); moe-profile
    profiles Unsloth and loralei, loralei with Liger (python3 is stubbed)."""
    subprocess.run(["bash", "-n", str(SCRIPT.parent / "run_gpu.sh")], check=True)
    calls = run_gpu_calls(tmp_path, "moe-liger", "moe", "moe-liger", "moe-profile")
    assert len(calls) == 6

    def opts(call: list[str], *keys: str) -> dict[str, str]:
        return {k: call[call.index(k) + 1] for k in keys}

    for call, n in ((calls[0], 1), (calls[3], 2)):
        assert opts(call, "--checkpointing", "--steps", "--warmup", "--tag") == {
            "--checkpointing": "both",
            "--steps": "5",
            "--warmup": "2",
            "--tag": f"moe-loralei-liger-{n}",
        }
        assert "--liger" in call
        assert call[call.index("--rows") + 1 : call.index("--steps")] == [
            "loralei-fused",
            "loralei-fused-lce",
        ]
    profiles = calls[4:]
    assert [c[1] for c in profiles] == ["benchmarks/profile_experts.py"] * 2
    assert [c[c.index("--row") + 1] for c in profiles] == ["unsloth-bf16", "loralei-fused-lce"]
    assert ["--liger" in c for c in profiles] == [False, True]
    for call, mode in zip(calls[1:3], ("off", "on"), strict=True):
        assert call[1] == "benchmarks/bench_train_step.py"
        assert opts(call, "--shape", "--checkpointing", "--steps", "--warmup", "--tag") == {
            "--shape": "qwen3-30b-a3b-8l",
            "--checkpointing": mode,
            "--steps": "5",
            "--warmup": "2",
            "--tag": f"moe-ckpt-{mode}",
        }
        rows = call[call.index("--rows") + 1 : call.index("--checkpointing")]
        assert rows == ["peft-bf16-adapters", "unsloth-bf16"]
        assert "--checkpoint-dir" in call and "--no-ops" in call and "--liger" not in call


def test_run_gpu_moe_fp8_and_nf4_bar_parts_put_the_runner_and_unsloth_in_one_call(tmp_path: Path) -> None:
    """run_gpu.sh's moe-bar: the runner in its three checkpointing modes (profiled), then Unsloth bf16 off and on,
    all from one saved MoE checkpoint; fp8-bar: Unsloth's FP8 row in both modes, then the runner with an FP8
    base in three modes; nf4-bar: Unsloth 4-bit, then the runner with an NF4 base off and offloaded; the
    quantized ones all from the 8B checkpoint (python3 is stubbed)."""
    calls = run_gpu_calls(tmp_path, "moe-bar", "fp8-bar", "nf4-bar")
    assert len(calls) == 12
    moe, fp8, nf4 = calls[:5], calls[5:9], calls[9:]
    assert [c[1] for c in moe] == ["benchmarks/bench_runner.py"] * 3 + ["benchmarks/bench_train_step.py"] * 2
    assert [c[c.index("--checkpointing") + 1] for c in moe] == ["off", "on", "offload", "off", "on"]
    assert {c[c.index("--shape") + 1] for c in moe} == {"qwen3-30b-a3b-8l"}
    assert all("--profile" in c for c in moe[:3])
    assert [c[c.index("--rows") + 1] for c in moe[3:]] == ["unsloth-bf16"] * 2
    ckpt = {c[c.index("--model-dir") + 1] for c in moe[:3]} | {
        c[c.index("--checkpoint-dir") + 1] for c in moe[3:]
    }
    assert ckpt == {"/tmp/bench-ckpt-qwen3-30b-a3b-8l"}
    assert [c[1] for c in fp8] == ["benchmarks/bench_train_step.py"] + ["benchmarks/bench_runner.py"] * 3
    assert fp8[0][fp8[0].index("--rows") + 1] == "unsloth-fp8" and "both" in fp8[0]
    assert [c[c.index("--checkpointing") + 1] for c in fp8[1:]] == ["off", "on", "offload"]
    assert all(c[c.index("--quantize") + 1] == "fp8" for c in fp8[1:])
    assert all(c[c.index("--profile-steps") + 1] == "2" for c in fp8[1:] + nf4[1:])  # the gaps between steps
    ckpt = {fp8[0][fp8[0].index("--checkpoint-dir") + 1]} | {c[c.index("--model-dir") + 1] for c in fp8[1:]}
    assert ckpt == {"/tmp/bench-ckpt-llama3-8b"}
    assert nf4[0][nf4[0].index("--rows") + 1] == "unsloth-4bit" and "both" in nf4[0]
    assert [c[c.index("--checkpointing") + 1] for c in nf4[1:]] == ["off", "offload"]
    assert all(c[c.index("--quantize") + 1] == "nf4" for c in nf4[1:])


def test_run_gpu_kept_short_part_runs_the_offloaded_runner_with_and_without_kept_attention(
    tmp_path: Path,
) -> None:
    """run_gpu.sh's kept-short: the 8B runner offloaded as it is, then keeping attention from one token, both
    profiled, from the 8B checkpoint (python3 is stubbed)."""
    calls = run_gpu_calls(tmp_path, "kept-short")
    assert [c[1] for c in calls] == ["benchmarks/bench_runner.py"] * 2
    assert all(c[c.index("--checkpointing") + 1] == "offload" and "--profile" in c for c in calls)
    assert (
        "--keep-attention-from" not in calls[0]
        and calls[1][calls[1].index("--keep-attention-from") + 1] == "1"
    )
    assert {c[c.index("--model-dir") + 1] for c in calls} == {"/tmp/bench-ckpt-llama3-8b"}


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


@pytest.mark.skipif(not _has("axolotl"), reason="needs axolotl")
def test_axolotl_rows_run_with_its_kernels_applied(tmp_path: Path) -> None:
    """Axolotl's LoRA and DoRA rows train in a child process (its patches rewrite the attention class), and its
    kernels are what runs: the attention's forward is Axolotl's, with its fused q/k/v and o functions."""
    bench = _load_bench()
    argv = ["--shape", "tiny", "--steps", "1", "--warmup", "1", "--no-ops", "--checkpointing", "both"]
    results = bench.main([*argv, "--rows", "axolotl-lora", "axolotl-dora", "--out-dir", str(tmp_path)])
    assert [(r["row"], r["checkpointing"]) for r in results["steps"]] == [
        (row, mode) for mode in (False, True) for row in ("axolotl-lora", "axolotl-dora")
    ]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in results["steps"])
    script = (
        "import sys, torch; from pathlib import Path; sys.path.insert(0, 'benchmarks'); import bench_rows as b\n"
        f"d = b.save_checkpoint('tiny', Path({str(tmp_path / 'ckpt')!r}), torch.device('cpu'), torch.float32)\n"
        "m = b.axolotl_model('axolotl-dora', 'tiny', d, torch.device('cpu'), torch.float32)\n"
        "a = m.base_model.model.model.layers[0].self_attn\n"
        "print(type(a).forward.__name__, a.apply_qkv.__func__.__name__, a.apply_o.__func__.__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=SCRIPT.parents[1], capture_output=True, text=True
    )
    assert "axolotl_attn_forward apply_lora_qkv apply_lora_o" in out.stdout, out.stderr[-2000:]


def test_run_gpu_dora_bar_part_runs_the_runner_then_peft_and_axolotl_dora(
    tmp_path: Path, monkeypatch
) -> None:
    """run_gpu.sh's dora-bar: the runner with LoRA and with DoRA in both modes, each with a profiled step, then
    PEFT's DoRA and Axolotl's DoRA kernels in one bench call; bar with BAR_PEERS=axolotl: Axolotl's LoRA kernels
    (python3 is stubbed)."""
    calls = run_gpu_calls(tmp_path, "dora-bar")
    assert [c[1] for c in calls] == ["benchmarks/bench_runner.py"] * 4 + ["benchmarks/bench_train_step.py"]
    assert ["--dora" in c for c in calls[:4]] == [False, True, False, True]
    profiles = [c[c.index("--profile") + 1].rsplit("/", 1)[1] for c in calls[:4]]
    assert profiles == [f"profile-dora-bar-{n}-{m}.json" for m in ("off", "on") for n in ("lora", "dora")]
    peers = calls[4]
    assert peers[peers.index("--rows") + 1 : peers.index("--rows") + 3] == ["peft-dora", "axolotl-dora"]
    monkeypatch.setenv("BAR_PEERS", "axolotl")
    monkeypatch.setenv("BAR_SHAPES", "llama3-8b")
    (tmp_path / "bar").mkdir()
    bar = run_gpu_calls(tmp_path / "bar", "bar")[-1]
    assert bar[bar.index("--rows") + 1] == "axolotl-lora" and "--liger" not in bar


def test_axolotl_rows_refuse_moe_shapes_and_liger(tmp_path: Path) -> None:
    rows = _load_rows()
    with pytest.raises(ValueError, match="Axolotl's kernels here patch dense MLPs"):
        rows.axolotl_model("axolotl-lora", "tiny-moe", tmp_path, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="axolotl-dora brings its own kernels; run it without --liger"):
        rows.prepared_model("tiny", "axolotl-dora", True, False, torch.device("cpu"), torch.float32, tmp_path)


def test_run_gpu_bar_part_runs_every_row_of_a_shape_in_one_call(tmp_path: Path) -> None:
    """run_gpu.sh's bar part: per shape, the runner in its three checkpointing modes, then Unsloth, PEFT + Liger
    and plain PEFT in both, each in its own process; 2 + 5 steps at 8B, 3 + 20 at Qwen3-0.6B (python3 is
    stubbed)."""
    calls = run_gpu_calls(tmp_path, "bar")
    assert len(calls) == 12
    for shape, group in (("llama3-8b", calls[:6]), ("qwen3-0.6b", calls[6:])):
        steps = ["5", "2"] if shape == "llama3-8b" else ["20", "3"]
        for call in group:
            assert call[call.index("--shape") + 1] == shape
            assert [call[call.index("--steps") + 1], call[call.index("--warmup") + 1]] == steps
        assert [c[1] for c in group] == ["benchmarks/bench_runner.py"] * 3 + [
            "benchmarks/bench_train_step.py"
        ] * 3
        assert [c[c.index("--checkpointing") + 1] for c in group] == ["off", "offload", "on"] + ["both"] * 3
        # the runner loads the shape's checkpoint from disk, written once per call
        assert {c[c.index("--model-dir") + 1] for c in group[:3]} == {f"/tmp/bench-ckpt-{shape}"}
        assert [c[c.index("--rows") + 1] for c in group[3:]] == ["unsloth-bf16"] + ["peft-bf16-adapters"] * 2
        assert ["--liger" in c for c in group[3:]] == [False, True, False]


def test_run_gpu_long_context_part_measures_each_length_against_unsloth(tmp_path: Path) -> None:
    """run_gpu.sh's long-context part: per length, the runner offloaded and Unsloth with its offloading, one row
    of that many tokens; then one runner step at 256K without warm-up, and the same step with its MLPs untiled,
    all from one saved checkpoint of one config; then the runner's memory by category at 32K and 128K, and the
    slopes of the call's files (python3 is stubbed)."""
    rows = _load_rows()
    assert {rows.SHAPES[f"llama3-8b-{n}"][1]["max_position_embeddings"] for n in rows.LONG_LENGTHS} == {
        262144
    }
    assert [rows.SHAPES[f"llama3-8b-{n}"][2:] for n in ("32k", "256k")] == [(1, 32768), (1, 262144)]
    calls = run_gpu_calls(tmp_path, "long-context")
    assert len(calls) == 11
    measured, memory, slope = calls[:8], calls[8:10], calls[10]
    shapes = [c[c.index("--shape") + 1] for c in measured]
    assert shapes == [f"llama3-8b-{n}" for n in ("32k", "32k", "64k", "64k", "128k", "128k", "256k", "256k")]
    assert [c[1] for c in measured] == [
        *["benchmarks/bench_runner.py", "benchmarks/bench_train_step.py"] * 3,
        *["benchmarks/bench_runner.py"] * 2,
    ]
    assert all(
        "--profile" in c for c in measured[:6:2]
    )  # the runner's rows at each length: one step profiled
    tiled, untiled = measured[6:]
    assert [c[c.index("--warmup") + 1] for c in (tiled, untiled)] == ["0", "0"]
    assert "--no-tiled-mlp" not in tiled and "--no-tiled-mlp" in untiled
    assert [Path(c[c.index("--out") + 1]).name for c in (tiled, untiled)] == [
        "long-runner-step.json",
        "long-runner-step-untiled.json",
    ]
    assert {c[c.index("--checkpointing") + 1] for c in measured} == {"offload", "on"}
    assert slope[1] == "benchmarks/long_context_slope.py" and slope[-2:] == [
        "--out",
        f"{slope[2]}/long-context.md",
    ]
    assert [(c[1], c[c.index("--shape") + 1], c[c.index("--checkpointing") + 1]) for c in memory] == [
        ("benchmarks/memory_step.py", f"llama3-8b-{n}", "offload") for n in ("32k", "128k")
    ]
    assert all("--snapshot" in c for c in memory)  # what is alive at the peak, by the code that made it
    calls = measured
    dirs = {c[c.index("--model-dir") + 1] for c in calls if "--model-dir" in c}
    dirs |= {c[c.index("--checkpoint-dir") + 1] for c in calls if "--checkpoint-dir" in c}
    assert dirs == {"/tmp/bench-ckpt-llama3-8b-long"}


def test_run_gpu_long_context_step_runs_one_tiling_when_asked(tmp_path: Path) -> None:
    """LONG_TILINGS splits the 256K step's two runs over two device calls: the untiled one alone here."""
    env = {"LONG_LENGTHS": "", "LONG_MEMORY": "", "LONG_TILINGS": "untiled"}
    calls = run_gpu_calls(tmp_path, "long-context", env=env)
    runs = [c for c in calls if c[1] == "benchmarks/bench_runner.py"]
    assert len(runs) == 1 and "--no-tiled-mlp" in runs[0]
    assert Path(runs[0][runs[0].index("--out") + 1]).name == "long-runner-step-untiled.json"


def test_run_gpu_long_context_rows_take_fewer_steps_when_asked(tmp_path: Path) -> None:
    """LONG_WARMUP and LONG_PROFILE=0 fit a 128K call into one device call: the runner warms up once and profiles
    no step; the defaults stay two warm-up steps and one profiled."""
    env = {"LONG_LENGTHS": "128k", "LONG_STEP": "", "LONG_MEMORY": "", "LONG_TIMED": "1"}
    short = {"LONG_WARMUP": "1", "LONG_PROFILE": "0"}
    for name, extra, warmup, profiled in (("short", short, "1", False), ("default", {}, "2", True)):
        (tmp_path / name).mkdir()
        calls = run_gpu_calls(tmp_path / name, "long-context", env=env | extra)
        runner = [c for c in calls if c[1] == "benchmarks/bench_runner.py"]
        assert len(runner) == 1 and runner[0][runner[0].index("--warmup") + 1] == warmup
        assert ("--profile" in runner[0]) == profiled and runner[0][runner[0].index("--steps") + 1] == "1"


def test_run_gpu_stream_bar_part_runs_the_runner_uncapped_then_streamed_under_the_cap(tmp_path: Path) -> None:
    """run_gpu.sh's stream-bar part (issue 46's 8B bar): the runner with offloaded checkpointing, then the same
    with layer offloading under a 10 GiB device cap, both from the 8B checkpoint, each profiled (python3 is
    stubbed)."""
    calls = run_gpu_calls(tmp_path, "stream-bar")
    assert [c[1] for c in calls] == ["benchmarks/bench_runner.py"] * 2
    for call in calls:
        assert call[call.index("--checkpointing") + 1] == "offload" and "--profile" in call
        assert call[call.index("--model-dir") + 1] == "/tmp/bench-ckpt-llama3-8b"
    assert "--layer-offloading" not in calls[0] and "--memory-cap-gib" not in calls[0]
    assert "--layer-offloading" in calls[1] and calls[1][calls[1].index("--memory-cap-gib") + 1] == "10"


@pytest.mark.parametrize("files", [3, 12])
def test_run_gpu_summarizes_profiles_and_packs_more_files_than_a_call_brings_back(
    tmp_path: Path, files: int
) -> None:
    """At its end run_gpu.sh writes each profile's summary beside it, and where the output holds more than the 8
    files a device call brings back, it leaves one archive of them all instead (python3 is stubbed: the summary
    is its echo)."""
    out = tmp_path / "out"
    (out / "dist").mkdir(parents=True)
    (out / "profile-fp8-bar-off.json").write_text("{}")
    (out / "dist" / "one-gpu.md").write_text("table")
    for i in range(files - 2):
        (out / f"row-{i}.json").write_text(str(i))
    calls = run_gpu_calls(tmp_path, "no-such-part")
    assert calls == [["python3", "benchmarks/profile_summary.py", str(out / "profile-fp8-bar-off.json")]]
    written = {"gpu.txt", "profile-fp8-bar-off.json", "profile-fp8-bar-off.txt", "dist/one-gpu.md"}
    written |= {f"row-{i}.json" for i in range(files - 2)}
    if files + 2 <= 8:
        assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} == written
        return
    assert [p.name for p in out.iterdir()] == ["results.tar.gz"]
    with tarfile.open(out / "results.tar.gz") as archive:
        names = {name.removeprefix("./") for name in archive.getnames()}
        assert written <= names
        assert archive.extractfile("./dist/one-gpu.md").read() == b"table"


def test_run_gpu_splits_an_archive_larger_than_a_returned_file_into_pieces(tmp_path: Path) -> None:
    """An archive over the size of a file a device call brings back goes in pieces that cat back into it."""
    out = tmp_path / "out"
    out.mkdir()
    rows = {
        f"row-{i}.bin": os.urandom(4000) for i in range(9)
    }  # incompressible: the archive stays over 30 KB
    for name, data in rows.items():
        (out / name).write_bytes(data)
    run_gpu_calls(tmp_path, "no-such-part", env={"RESULTS_PIECE_BYTES": "10000"})
    pieces = sorted(out.iterdir())
    assert len(pieces) >= 4 and all(p.name.startswith("results.tar.gz.part-") for p in pieces)
    assert all(p.stat().st_size <= 10000 for p in pieces)
    joined = tmp_path / "results.tar.gz"
    joined.write_bytes(b"".join(p.read_bytes() for p in pieces))
    with tarfile.open(joined) as archive:
        assert all(archive.extractfile(f"./{name}").read() == data for name, data in rows.items())


def test_the_peft_dora_row_trains_peft_dora_adapters(tmp_path: Path) -> None:
    bench = _load_bench()
    argv = ["--tiny", "--no-ops", "--rows", "peft-dora", "--out-dir", str(tmp_path), "--tag", "dora"]
    results = bench.main(argv)
    assert {r["row"] for r in results["steps"]} == {"peft-dora"}
    assert all(r["tokens_per_s"] > 0 for r in results["steps"])
    rows = _load_rows()
    assert rows.peft_config("tiny", dora=True).use_dora and not rows.peft_config("tiny").use_dora


def test_run_gpu_sequence_parallel_part_sets_each_length_split_over_the_gpus_against_one(
    tmp_path: Path,
) -> None:
    """run_gpu.sh's sequence-parallel part (issue 50): per length, the runner in one process, then under torchrun
    with each sequence split over the GPUs, both checkpointed, without graphs, from the long checkpoint (one warm-up
    step below 256K, none at 256K); then the table of the runs that wrote their files; one GPU skips it all
    (python3 is stubbed)."""
    (tmp_path / "out").mkdir()
    for name in ("sp-1gpu-128k", "sp-2gpu-128k"):  # what the stubbed runs would have written
        (tmp_path / "out" / f"{name}.json").write_text("{}")
    calls = run_gpu_calls(tmp_path, "sequence-parallel", env={"SP_GPUS": "2"})
    assert len(calls) == 5
    out = str(tmp_path / "out")
    for i, (length, warmup) in enumerate([("128k", "1"), ("256k", "0")]):
        one, split = calls[2 * i : 2 * i + 2]
        assert one[1] == "benchmarks/bench_runner.py" and "--sequence-parallel" not in one
        assert split[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        assert (
            split[6] == "benchmarks/bench_runner.py" and split[split.index("--sequence-parallel") + 1] == "2"
        )
        for call, name in [(one, f"sp-1gpu-{length}"), (split, f"sp-2gpu-{length}")]:
            assert call[call.index("--shape") + 1] == f"llama3-8b-{length}"
            assert call[call.index("--checkpointing") + 1] == "on" and "--no-cuda-graphs" in call
            assert call[call.index("--warmup") + 1] == warmup and call[call.index("--steps") + 1] == "1"
            assert call[call.index("--model-dir") + 1] == "/tmp/bench-ckpt-llama3-8b-long"
            assert call[call.index("--out") + 1] == f"{out}/{name}.json"
    assert calls[4] == [
        "python3",
        "benchmarks/sequence_parallel_table.py",
        f"{out}/sp-1gpu-128k.json",
        f"{out}/sp-2gpu-128k.json",
        "--out",
        f"{out}/sequence-parallel.md",
    ]
    (tmp_path / "one").mkdir()
    assert run_gpu_calls(tmp_path / "one", "sequence-parallel") == []  # nvidia-smi stubbed: one GPU
