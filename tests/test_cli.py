"""loralei-finetune: argument handling, exit codes, readable errors, and the quickstart end to end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from loralei import cli
from loralei.train import run as run_module
from loralei.train.loop import TrainingError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
MOE_QUICKSTART = ROOT / "examples" / "quickstart-moe.yaml"


def write(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


GOOD = {"model": {"name_or_path": "m"}, "data": {"path": "d"}, "output_dir": "out"}  # hub ids: not checked


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "loralei-finetune validate examples/quickstart.yaml" in capsys.readouterr().out


def test_bad_config_lists_every_problem_and_exits_2(tmp_path, capsys):
    path = write(tmp_path, {**GOOD, "training": {"max_seq_lenght": 8, "packing": "maybe"}, "lora": {"r": 0}})
    assert cli.main([path]) == 2
    err = capsys.readouterr().err
    assert "(3 problems)" in err
    assert 'training.max_seq_lenght: unknown key (did you mean "max_seq_length"?)' in err
    assert "training.packing:" in err and "lora.r:" in err
    assert "Traceback" not in err


def test_overrides_are_applied_before_validation(tmp_path, capsys):
    path = write(tmp_path, GOOD)
    assert cli.main(["validate", path, "training.max_steps=0"]) == 2
    assert (
        "training.max_steps: must be a whole number >= 1, e.g. training.max_steps: 1000 (got 0)"
        in capsys.readouterr().err
    )
    assert cli.main([path, "training.max_steps"]) == 2
    assert "must look like dotted.key=value" in capsys.readouterr().err


def test_missing_config_file(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["validate"])


def test_train_prints_the_summary_and_training_failures_exit_1(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, GOOD)
    seen = {}

    class Result:
        def summary(self) -> str:
            return "finished 3 steps"

    def fake_train(cfg):
        seen["steps"] = cfg.training.max_steps
        return Result()

    monkeypatch.setattr(run_module, "train", fake_train)
    assert cli.main([path, "training.max_steps=3"]) == 0
    assert seen["steps"] == 3 and "finished 3 steps" in capsys.readouterr().out

    def diverging(cfg):
        raise TrainingError("loss was non-finite for 10 consecutive steps")

    monkeypatch.setattr(run_module, "train", diverging)
    assert cli.main([path]) == 1
    assert "training stopped: loss was non-finite" in capsys.readouterr().err


def test_other_processes_print_no_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_module, "train", lambda cfg: None)  # what train returns off the main process
    assert cli.main([write(tmp_path, GOOD)]) == 0
    assert capsys.readouterr().out == ""


def test_quickstart_validates(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert cli.main(["validate", str(QUICKSTART)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config OK") and "trainable" in out
    assert (
        "training.cuda_graphs: auto -> off: no CUDA device" in out.splitlines()
    )  # what a run here would choose


def test_validate_checks_the_optimizer_options(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert cli.main(["validate", str(QUICKSTART), "optimizer.betas=[1.5,0.9]"]) == 2
    assert "optimizer.betas: must be two numbers in [0, 1)" in capsys.readouterr().err
    assert cli.main(["validate", str(QUICKSTART), "training.max_steps=5", "optimizer.warmup_steps=6"]) == 2
    assert "optimizer.warmup_steps: 6 is not below training.max_steps 5" in capsys.readouterr().err


def test_quickstart_trains_a_few_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qs"
    args = [str(QUICKSTART), "training.max_steps=3", "optimizer.warmup_steps=1", f"output_dir={out}"]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert "finished 3 steps" in capsys.readouterr().out
    assert (out / "adapter_peft" / "adapter_model.safetensors").is_file()
    assert os.path.getsize(out / "log.jsonl") > 0


def test_qlora_quickstart_learns_with_nf4_bases(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torchao")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "qlora"
    config = ROOT / "examples" / "quickstart-qlora.yaml"
    args = [str(config), "training.max_steps=60", "training.logging_steps=10", f"output_dir={out}"]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert "finished 60 steps" in capsys.readouterr().out
    losses = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.7 * losses[0]
    saved = json.loads((out / "adapter" / "loralei_config.json").read_text())["lora_config"]
    assert saved["quantize_base"] and saved["nf4_block_size"] == 32


FP8_BASES = ["lora.quantize_base=true", "lora.quantization_type=fp8"]


def test_quickstart_learns_with_emulated_fp8_bases(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torchao")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "fp8"
    args = [str(QUICKSTART), *FP8_BASES, "lora.fp8_kernel=emulated", "training.max_steps=60"]
    assert cli.main([*args, "training.logging_steps=10", f"output_dir={out}"]) == 0, capsys.readouterr().err
    assert "finished 60 steps" in capsys.readouterr().out
    losses = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.7 * losses[0]
    saved = json.loads((out / "adapter" / "loralei_config.json").read_text())["lora_config"]
    assert saved["quantization_type"] == "fp8" and saved["fp8_kernel"] == "emulated"


def test_fp8_bases_without_an_fp8_gpu_name_the_fix(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torchao")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has an FP8-capable GPU")
    monkeypatch.chdir(ROOT)
    assert cli.main([str(QUICKSTART), *FP8_BASES, f"output_dir={tmp_path / 'fp8'}"]) == 2
    err = capsys.readouterr().err
    assert (
        "loralei-finetune: fp8_kernel='auto' runs FP8 GEMMs, which need a CUDA GPU of compute capability"
        in err
    )
    assert "set fp8_kernel='emulated'" in err


def test_packed_parquet_example_trains_a_few_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "pp"
    config = ROOT / "examples" / "packed-parquet.yaml"
    args = [str(config), "training.max_steps=2", "optimizer.warmup_steps=1", f"output_dir={out}"]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert "finished 2 steps" in capsys.readouterr().out


def test_moe_quickstart_trains_attention_and_expert_factors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "moe"
    args = [str(MOE_QUICKSTART), "training.max_steps=10", "training.logging_steps=2", f"output_dir={out}"]
    assert cli.main(args) == 0, capsys.readouterr().err
    summary = capsys.readouterr().out
    assert "finished 10 steps" in summary
    assert "LoRA: r=16 on 8 linear modules and 4 expert banks (2 experts modules of 8 experts)" in summary
    losses = [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 5 and losses[-1] < 0.7 * losses[0]
    with safe_open(out / "adapter" / "loralei_adapter.safetensors", "pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    for layer in (0, 1):
        experts = f"model.layers.{layer}.mlp.experts"
        assert shapes[f"{experts}.lora_A.gate_up_proj"] == (8, 16, 64)  # experts × r × in
        assert shapes[f"{experts}.lora_B.gate_up_proj"] == (8, 64, 16)  # experts × (gate + up) × r
        assert shapes[f"{experts}.lora_A.down_proj"] == (8, 16, 32)
        assert shapes[f"{experts}.lora_B.down_proj"] == (8, 64, 16)
        assert shapes[f"model.layers.{layer}.self_attn.q_proj.lora_A.weight"] == (16, 64)
    assert len(shapes) == 2 * (8 + 4)  # A and B of 4 projections and 2 banks per layer, nothing else


def test_moe_target_errors_stop_before_training(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "moe"
    typo = [str(MOE_QUICKSTART), "lora.target_parameters=[experts.gate_proj]", f"output_dir={out}"]
    assert cli.main(typo) == 2
    err = capsys.readouterr().err
    assert (
        "\nloralei-finetune: lora.target_parameters: entry 'experts.gate_proj' matches no expert bank" in err
    )
    assert not (out / "log.jsonl").exists()  # no step ran
    dropout = [str(MOE_QUICKSTART), "lora.lora_dropout=0.1", f"output_dir={out}"]
    assert cli.main(dropout) == 2
    assert "lora.lora_dropout: 0.1 cannot be combined with lora.target_parameters" in capsys.readouterr().err


def test_the_long_context_example_is_a_valid_config() -> None:
    """examples/long-context.yaml reads without a problem, with its RoPE override and the long-row settings."""
    from loralei.train.loading import load_config

    cfg = load_config(ROOT / "examples" / "long-context.yaml")
    assert cfg.model.config_overrides["rope_scaling"]["rope_type"] == "yarn"
    assert cfg.training.max_seq_length == 65536 and cfg.training.packing and cfg.training.tiled_mlp == "auto"
