"""benchmarks/bench_runner.py on the CPU: the runner with its defaults trains the tiny shape through its own loop,
the timed steps give a rate, and the JSON names what the auto settings chose."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launching import child_env

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_runner
import gptq_checkpoint
import sequence_parallel_table
from safetensors.torch import load_file

from checkpoint_quant import gptq_reference


def _argv(steps: int, shape: str = "tiny") -> list[str]:
    """A CPU run of ``shape`` in float32: one warm-up step, then ``steps`` timed ones."""
    return ["--shape", shape, "--dtype", "float32", "--steps", str(steps), "--warmup", "1"]


@pytest.mark.parametrize("checkpointing", ["off", "offload"])
def test_the_runner_with_its_defaults_is_timed(tmp_path: Path, checkpointing: str) -> None:
    out = tmp_path / "runner.json"
    argv = [*_argv(2), "--out", str(out)]
    result = bench_runner.main([*argv, "--checkpointing", checkpointing])
    assert json.loads(out.read_text()) == result
    assert result["row"] == "loralei-runner (defaults)" and result["tokens_per_s"] > 0
    assert result["checkpointing"] == checkpointing
    # each timed step's host time (no sync): on the CPU the host is the device, so they sum to the timed span
    steps_ms = result["host_step_ms"]
    assert len(steps_ms) == 2 and all(ms > 0 for ms in steps_ms)
    _, _, batch, seq = bench_runner.SHAPES["tiny"]
    assert sum(steps_ms) == pytest.approx(2 * batch * seq / result["tokens_per_s"] * 1e3, rel=0.05)
    assert len(result["gc_runs"]) == 3 and all(n >= 0 for n in result["gc_runs"])
    assert result["auto_choices"] == [
        "training.liger_kernel: auto -> off: no CUDA device",
        "training.loss: auto -> cross_entropy (cpu: the plain head and loss)",
        "training.cuda_graphs: auto -> off: no CUDA device",
    ]
    assert (
        result["notes"] == [] and result["peak_reserved_gib"] is None
    )  # no CUDA: no graphs, no device memory
    # the runner's own first lines say the same, and more (its fusion report)
    assert set(result["auto_choices"]) <= set(result["runner_notes"])
    assert any(note.startswith("loralei fusion:") for note in result["runner_notes"])
    assert result["setup_peak_gib"] is None and result["loaded_from"] == "disk (model.name_or_path)"


def test_moe_shapes_adapt_attention_and_both_expert_banks(tmp_path: Path) -> None:
    """On an MoE shape the runner's LoRA covers what bench_train_step's rows and Unsloth adapt: q/k/v/o and the
    experts' two banks (all-linear alone would leave the experts untouched)."""
    argv = _argv(1, "tiny-moe")
    result = bench_runner.main([*argv, "--out", str(tmp_path / "moe.json")])
    layers = bench_runner.SHAPES["tiny-moe"][1]["num_hidden_layers"]
    banks = f"{2 * layers} expert banks ({layers} experts modules"
    assert result["adapter"].startswith(f"r=16 on {4 * layers} linear modules and {banks}")
    assert result["tokens_per_s"] > 0


def test_the_model_is_loaded_from_a_checkpoint_written_once(tmp_path: Path) -> None:
    """--model-dir: the shape's checkpoint is written on the first run and loaded by the runner from there, as a
    user's model is; a later run reuses it, and a directory of another shape is refused."""
    model_dir = tmp_path / "models" / "tiny"
    argv = [*_argv(1), "--model-dir", str(model_dir)]
    bench_runner.main([*argv, "--out", str(tmp_path / "a.json")])
    weights = model_dir / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    result = bench_runner.main([*argv, "--out", str(tmp_path / "b.json")])
    assert weights.stat().st_mtime_ns == written and result["tokens_per_s"] > 0
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    with pytest.raises(SystemExit, match=r"holds a checkpoint of another shape \(its hidden_size differ"):
        bench_runner.main([*argv, "--out", str(tmp_path / "c.json")])


def test_a_flag_that_changes_the_defaults_is_named_in_the_row(tmp_path: Path, monkeypatch) -> None:
    """--quantize runs QLoRA through the runner (NF4 base) and the row says so."""
    config = bench_runner.run_config

    # the tiny shape's weights are smaller than NF4's default blocks
    def small_blocks(args, out_dir, model_dir=None):
        cfg = config(args, out_dir, model_dir)
        cfg["lora"]["nf4_scaler_block_size"] = 8
        return cfg

    monkeypatch.setattr(bench_runner, "run_config", small_blocks)
    out = tmp_path / "runner.json"
    argv = [*_argv(1), "--out", str(out)]
    result = bench_runner.main([*argv, "--quantize", "nf4", "--no-liger", "--no-cuda-graphs"])
    assert result["row"] == "loralei-runner (defaults, no Liger, no CUDA graphs, nf4 base)"
    assert result["quantization_type"] == "nf4" and result["tokens_per_s"] > 0
    assert "model: read one decoder layer at a time, each packed as it arrived" in result["runner_notes"]


def test_random_layers_are_made_and_packed_one_at_a_time_for_a_streamed_run(
    tmp_path: Path, monkeypatch
) -> None:
    """--random-layers (shapes whose checkpoint the disk cannot hold): no checkpoint is written, the weights are
    made layer by layer and packed, and the runner trains on them, here with its layers streamed."""
    config = bench_runner.run_config

    def small_blocks(args, out_dir, model_dir=None):
        assert model_dir is None  # nothing on disk
        cfg = config(args, out_dir, model_dir)
        cfg["lora"]["nf4_scaler_block_size"] = 8
        return cfg

    monkeypatch.setattr(bench_runner, "run_config", small_blocks)
    flags = ["--quantize", "nf4", "--random-layers", "--checkpointing", "offload", "--layer-offloading"]
    result = bench_runner.main([*_argv(1), "--out", str(tmp_path / "runner.json"), *flags])
    assert result["loaded_from"] == "random layers, made and packed one at a time"
    assert result["tokens_per_s"] > 0 and result["host_peak_gib"] > 0
    assert any(
        note.startswith("training.layer_offloading: the frozen weights") for note in result["runner_notes"]
    )
    with pytest.raises(SystemExit):
        bench_runner.parse_args([*_argv(1), "--out", "x.json", "--random-layers"])  # needs --quantize


def test_a_profiled_step_after_the_timed_ones_is_summarised(tmp_path: Path) -> None:
    """--profile runs one more step after the timed ones and writes its summary: wall ms, the kernel categories
    (none on the CPU), the top CPU ops and the host syncs; the timed steps still give a rate."""
    out, profile = tmp_path / "runner.json", tmp_path / "profile" / "runner.json"
    argv = [*_argv(2), "--out", str(out)]
    result = bench_runner.main([*argv, "--profile", str(profile)])
    assert json.loads(out.read_text()) == result
    assert result["tokens_per_s"] > 0 and result["steps"] == 2
    assert result["profile"] == str(profile)
    summary = json.loads(profile.read_text())
    assert summary["row"] == "loralei-runner (defaults)" and summary["checkpointing"] == "off"
    assert summary["profiled_step"] == 4  # 1 warm-up, 2 timed, then the profiled one
    assert summary["wall_ms"] > 0 and summary["timed_step_ms"] > 0
    assert summary["categories_ms"] == {} and summary["total_ms"] == summary["gpu_busy_ms"] == 0  # no CUDA
    assert summary["top_kernels"] == [] and summary["lora_gemm_ms"] == 0
    assert summary["idle_ms"] == 0 and summary["longest_gaps"] == []  # no device events, no gaps between them
    ops = summary["cpu_ops"]
    assert 0 < len(ops) <= 15 and {"aten::mm", "aten::addmm"} & {op["name"] for op in ops}
    assert all(set(op) == {"name", "count", "self_ms", "total_ms"} for op in ops)
    assert [op["self_ms"] for op in ops] == sorted((op["self_ms"] for op in ops), reverse=True)
    assert list(summary["host_syncs"]) == [
        "cudaStreamSynchronize",
        "cudaDeviceSynchronize",
        "cudaEventSynchronize",
        "aten::item",
        "aten::_local_scalar_dense",
    ]
    assert summary["host_syncs"]["cudaDeviceSynchronize"] == {"count": 0, "self_ms": 0.0, "total_ms": 0.0}
    assert summary["host_syncs"]["aten::item"]["count"] > 0  # the step's verdict is read on the host


def test_the_profiled_step_comes_after_the_clock_stops(tmp_path: Path, monkeypatch) -> None:
    """The clock still spans the timed steps (after warm-up step 1 to step 3); the profiler starts after its stop
    (the same step's later callback) and profiles step 4, which --profile adds to the run."""
    made = {}

    def keep(cls):
        class Kept(cls):
            def __init__(self, *args) -> None:
                super().__init__(*args)
                made[cls.__name__] = self

        return Kept

    monkeypatch.setattr(bench_runner, "StepClock", keep(bench_runner.StepClock))
    monkeypatch.setattr(bench_runner, "StepProfile", keep(bench_runner.StepProfile))
    argv = _argv(2)
    bench_runner.main([*argv, "--out", str(tmp_path / "r.json"), "--profile", str(tmp_path / "p.json")])
    clock, profiler = made["StepClock"], made["StepProfile"]
    assert (clock.warmup, clock.last, profiler.step) == (1, 3, 4)
    assert 0 < clock.start < clock.stop <= profiler.start


def test_without_warm_up_the_clock_starts_after_setup_as_the_first_batch_is_made(
    tmp_path: Path, monkeypatch
) -> None:
    """--warmup 0 (a step long enough to be timed alone, as at 256K tokens): the clock cannot start in a step
    callback, so it starts when the loader makes the first batch, after the runner's setup, once; the one timed
    step is the run's first, and its loss is reported."""
    from loralei.train import run as run_module

    made, marks = {}, []

    class Kept(bench_runner.StepClock):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made["clock"] = self

        def _start(self) -> None:
            marks.append("clock")
            super()._start()

    setup_training = run_module.setup_training

    def noted(*args, **kwargs):
        made["setup"] = setup_training(*args, **kwargs)
        marks.append("setup done")
        return made["setup"]

    monkeypatch.setattr(bench_runner, "StepClock", Kept)
    monkeypatch.setattr(run_module, "setup_training", noted)
    argv = ["--shape", "tiny", "--dtype", "float32", "--steps", "1", "--warmup", "0"]
    result = bench_runner.main([*argv, "--out", str(tmp_path / "r.json")])
    clock = made["clock"]
    assert marks == ["setup done", "clock"] and 0 < clock.start < clock.stop
    assert len(result["host_step_ms"]) == 1 and result["tokens_per_s"] > 0
    _, _, batch, seq = bench_runner.SHAPES["tiny"]
    assert result["tokens_per_s"] == pytest.approx(batch * seq / (clock.stop - clock.start))
    assert result["warmup"] == 0 and torch.isfinite(torch.tensor(result["last_loss"]))


def test_no_tiled_mlp_runs_the_mlps_whole_and_names_itself(tmp_path: Path) -> None:
    """--no-tiled-mlp sets training.tiled_mlp: false (the long shapes' check that tiles give the same loss)."""
    argv = [*_argv(1), "--no-tiled-mlp", "--out", str(tmp_path / "r.json")]
    args = bench_runner.parse_args(argv)
    assert bench_runner.run_config(args, tmp_path / "run")["training"]["tiled_mlp"] is False
    default = bench_runner.parse_args([*_argv(1), "--out", str(tmp_path / "d.json")])
    assert bench_runner.run_config(default, tmp_path / "run")["training"]["tiled_mlp"] == "auto"
    result = bench_runner.main(argv)
    assert result["row"] == "loralei-runner (defaults, MLP untiled)" and result["tokens_per_s"] > 0


def test_profile_steps_profiles_that_many_steps_back_to_back(tmp_path: Path, monkeypatch) -> None:
    """--profile-steps 2 adds two steps after the timed ones and profiles both from one sync to one sync: the
    profiler starts after the clock's stop and its span holds two steps' ops."""
    made = {}

    class Kept(bench_runner.StepProfile):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            made["profiler"] = self

    monkeypatch.setattr(bench_runner, "StepProfile", Kept)
    argv = [*_argv(2), "--out", str(tmp_path / "r")]
    bench_runner.main([*argv, "--profile", str(tmp_path / "p.json"), "--profile-steps", "2"])
    profiler = made["profiler"]
    assert (profiler.first, profiler.step) == (4, 5)
    summary = json.loads((tmp_path / "p.json").read_text())
    assert (summary["profiled_step"], summary["profiled_steps"]) == (5, 2)
    steps = [e for e in profiler.prof.events() if e.name.startswith("Optimizer.step")]
    assert len(steps) == 2


def test_layer_offloading_runs_and_names_itself(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "streamed.json"
    result = bench_runner.main([*_argv(1), "--checkpointing", "on", "--layer-offloading", "--out", str(out)])
    assert result["row"] == "loralei-runner (defaults, layer offloading)" and result["tokens_per_s"] > 0
    captured = capsys.readouterr()
    assert (
        "training.layer_offloading: the frozen weights of" in captured.out + captured.err
    )  # the run's report


def test_a_memory_cap_without_cuda_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--memory-cap-gib caps CUDA memory"):
        bench_runner.main([*_argv(1), "--memory-cap-gib", "10", "--out", str(tmp_path / "x.json")])


def test_a_gptq_copy_of_the_checkpoint_is_read_by_the_runner(tmp_path: Path) -> None:
    """--gptq: the runner trains on a GPTQ copy of the shape's checkpoint (written beside it once), whose
    weights dequantize to within half a quantization step of the saved ones."""
    model_dir = tmp_path / "model"
    argv = [*_argv(1), "--gptq", "--model-dir", str(model_dir), "--out", str(tmp_path / "gptq.json")]
    result = bench_runner.main(argv)
    assert result["row"] == "loralei-runner (defaults, GPTQ checkpoint)" and result["tokens_per_s"] > 0
    assert result["quantization_type"] == "gptq"
    dense, packed = (load_file(next(d.glob("*.safetensors"))) for d in (model_dir, tmp_path / "model-gptq"))
    name = "model.layers.0.mlp.down_proj"
    parts = {p: packed[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
    step = parts["scales"].float().amax()
    assert (
        gptq_reference(parts, 1, torch.float32) - dense[f"{name}.weight"].float()
    ).abs().max() <= step / 2 + 1e-6
    assert f"{name}.weight" not in packed


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_quantization_rounds_each_weight_to_its_group_grid(act_order: bool) -> None:
    weight = torch.randn(16, 64)
    parts = gptq_checkpoint.quantize(weight, 16, act_order)
    scale = parts["scales"].float()[parts["g_idx"].long()].t()  # (out, in): each weight's own step
    assert ((gptq_reference(parts, 1, torch.float32) - weight).abs() <= scale / 2 + 1e-6).all()
    assert sorted(parts["g_idx"].bincount().tolist()) == [16] * 4


def test_keep_attention_from_probes_the_kept_attention_threshold(tmp_path: Path, monkeypatch) -> None:
    """--keep-attention-from: offloaded rows this long keep attention results (the tiny shape's rows are short of
    the runner's 32K, which keeps none), and the row says so."""
    from loralei.train import kept_attention

    def kept(result: dict) -> bool:
        return any(note.startswith("attention: computed once per step") for note in result["runner_notes"])

    monkeypatch.setattr(kept_attention, "AUTO_TOKENS", kept_attention.AUTO_TOKENS)  # restored after the test
    argv = [*_argv(1), "--checkpointing", "offload", "--out", str(tmp_path / "r.json")]
    assert not kept(bench_runner.main(argv))
    result = bench_runner.main([*argv, "--keep-attention-from", "16"])
    assert result["row"] == "loralei-runner (defaults, attention kept from 16 tokens)" and kept(result)


def _torchrun(argv: list[str], processes: int) -> None:
    """bench_runner.py under torchrun, every process on the CPU (gloo)."""
    env = child_env()
    runner = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(processes),
    ]
    script = Path(bench_runner.__file__)
    proc = subprocess.run([*runner, str(script), *argv], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_each_sequence_split_over_two_processes_trains_like_one(tmp_path: Path) -> None:
    """--sequence-parallel 2 under torchrun: the runner splits each row of the tiny shape (4 heads) over the two
    processes; the main process writes one result with both ranks' numbers, the same tokens a step as one
    process, and the one-process run's losses (fp32: the order of sums only)."""
    model_dir = tmp_path / "model"
    argv = [*_argv(2), "--model-dir", str(model_dir), "--checkpointing", "on"]
    one = bench_runner.main([*argv, "--out", str(tmp_path / "one.json")])  # writes the checkpoint
    _torchrun([*argv, "--sequence-parallel", "2", "--out", str(tmp_path / "sp.json")], processes=2)
    split = json.loads((tmp_path / "sp.json").read_text())
    assert (split["processes"], split["sequence_parallel_size"], len(split["ranks"])) == (2, 2, 2)
    assert split["row"] == "loralei-runner (defaults, each sequence over 2 GPUs)"
    assert split["tokens_per_step"] == one["tokens_per_step"] and split["tokens_per_s"] > 0
    assert any("each sequence split over 2 ranks (Ulysses" in note for note in split["runner_notes"])
    for loss in ("first_loss", "last_loss"):
        assert split[loss] == pytest.approx(one[loss], rel=1e-5), loss
    runs = [str(tmp_path / "sp.json"), str(tmp_path / "one.json")]
    lines = sequence_parallel_table.main([*runs, "--out", str(tmp_path / "sp.md")]).splitlines()
    assert lines[2].startswith("| tiny | 1 |") and "| 1.00× | n/a |" in lines[2]  # the baseline, first
    ratio = split["tokens_per_s"] / one["tokens_per_s"]
    assert lines[3].startswith("| tiny | 2 |") and f"| {ratio:.2f}× | n/a |" in lines[3]
    assert float(lines[3].split("|")[-2]) < 1e-5  # the losses' relative difference


def test_sequence_parallel_runs_need_a_written_checkpoint(tmp_path: Path, monkeypatch) -> None:
    argv = [*_argv(1), "--model-dir", str(tmp_path / "none"), "--out", str(tmp_path / "x.json")]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="holds no checkpoint yet, and 2 processes would each write it"):
        bench_runner.main([*argv, "--sequence-parallel", "2"])
    assert not (tmp_path / "none").exists()


def test_a_prompt_share_leaves_each_rows_first_tokens_untrained(tmp_path: Path) -> None:
    rows = bench_runner.token_rows("tiny", 2, prompt_share=0.25)
    seq = len(rows[0]["input_ids"])
    assert all(r["labels"][: seq // 4] == [-100] * (seq // 4) for r in rows)
    assert all(r["labels"][seq // 4 :] == r["input_ids"][seq // 4 :] for r in rows)
    result = bench_runner.main([*_argv(1), "--prompt-share", "0.25", "--out", str(tmp_path / "p.json")])
    assert result["row"] == "loralei-runner (defaults, the first 25% of each row untrained)"
    assert result["prompt_share"] == 0.25 and result["tokens_per_s"] > 0
