"""Multi-process training through torchrun, 2 processes: the same run as one process with the same global batch
(DDP and FSDP2, whose adapter export gathers every shard), unequal token counts per rank normalised over all
ranks, kill-and-resume equal to an uninterrupted run, a failing or killed rank ending the job; and the launch
checks that need no processes.

On a machine with two CUDA devices every run uses them (NCCL, one GPU per rank; the one-process twin on the
first GPU); elsewhere the processes see no CUDA device and run on the CPU (gloo), as in CI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ddp_worker import EXIT_CRASHED, lora_model, unequal_window
from safetensors.torch import load_file
from test_quantized_checkpoint import write_checkpoint
from test_run import adapter_tensors, losses

from launching import child_env
from loralei.errors import ConfigError
from loralei.peft_format import PEFT_WEIGHTS
from loralei.train import launch
from loralei.train.loop import LoopSettings, _forward_backward
from loralei.train.losses import cross_entropy_loss
from loralei.train.state import Trainables
from tolerances import assert_fp32_close

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
# fp32 on the CPU; the runs differ only in the order of floating-point sums (each rank's partial gradient, then
# the all-reduce, against one sum over the whole batch) and in padding per rank: ~1e-7 relative per step, a few
# times that after Adam's steps. 1e-5 leaves a margin of 10-100x, while normalising by the rank's own token count
# instead of the global one moves the loss and the gradients by percents (the token counts differ per rank).
RTOL = 1e-5
# Two GPUs: NCCL on CUDA, in fp32 (the fused kernels' fp32 products are IEEE, not TF32). cuBLAS picks its kernels
# (tile shapes, split-K) by the row count, which differs between a rank's 2 rows and the twin's 4, so the sums
# are grouped differently again: 1e-4 still lies 100x below the effect of a wrong normalisation.
CUDA = torch.cuda.device_count() >= 2
if CUDA:
    RTOL = 1e-4


def _launch(args: list[str], nproc: int | None, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    """The worker under torchrun (or ``accelerate launch``) with ``nproc`` processes, or as one plain process
    (``None``)."""
    env = child_env(gpus=CUDA)  # fewer than two GPUs: every process on the CPU, the twin too
    runner = [sys.executable]
    if nproc is not None and launcher == "accelerate":  # its multi-process launch goes through torchrun
        runner += ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc)]
        runner += [
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "0",
        ]
    elif nproc is not None:  # --standalone: a rendezvous on a free local port, chosen by torchrun itself
        runner += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    try:
        return subprocess.run(
            [*runner, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as exc:  # a hung rank: fail with what the processes printed
        pytest.fail(f"{' '.join(args)} did not finish in 300 s:\n{exc.stderr or ''}"[-6000:])


def assert_trains_like_one_process(run: Path, one: Path) -> None:
    """The multi-process run in ``run`` logged the 6 losses of the one-process run in ``one`` (within RTOL) and
    saved its adapter (each tensor within 10 RTOL, norm-wise as every tolerance in tests/tolerances.py: element by
    element, a factor's smallest entries, whose gradients Adam normalises, move by more than their share and
    differently on every CPU's kernels; a sequence-parallel run's 0.0024 moved by 1.5e-6 on an AVX2 EPYC while its
    tensor stayed within 5e-6)."""
    got, want = losses(run), losses(one)
    assert len(got) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)
    got, want = adapter_tensors(run / "adapter"), adapter_tensors(one / "adapter")
    for name in want:
        assert_fp32_close(got[name], want[name], name, tolerance=10 * RTOL)


# QLoRA: NF4 blocks that divide the tiny model's 32-wide weights
NF4 = {"quantize_base": True, "nf4_block_size": 16, "nf4_scaler_block_size": 2}
DORA = {"use_dora": True}  # the magnitudes train beside the factors (and are sharded with them under FSDP2)


def _config(tmp_path: Path, name: str, lora: dict | None = None, **training) -> Path:
    raw = {
        "model": {"name_or_path": "tiny-llama"},
        "data": {"path": "in-memory"},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": training.pop("dropout", 0.0), **(lora or {})},
        "training": {"max_steps": 6, "gradient_accumulation_steps": 2, "logging_steps": 1, **training},
        "optimizer": {"name": "adamw", "lr": 1e-2, "warmup_steps": 1},
        "output_dir": str(tmp_path / name),
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(raw))
    return path


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize(
    ("mode", "lora", "extra"),
    [
        ("ddp", None, {}),
        ("fsdp2", None, {}),
        ("fsdp2", NF4, {}),
        ("fsdp2", None, {"gradient_checkpointing": True}),
        ("ddp", NF4, {"gradient_checkpointing": True, "layer_offloading": True}),
        ("ddp", None, {"gradient_checkpointing": "offload"}),
        ("ddp", DORA, {}),
        ("fsdp2", DORA, {"gradient_checkpointing": True}),
    ],
    ids=[
        "ddp",
        "fsdp2",
        "fsdp2-nf4",
        "fsdp2-checkpointing",
        "ddp-nf4-layer-offloading",
        "ddp-offload",
        "ddp-dora",
        "fsdp2-dora-checkpointing",
    ],
)
def test_two_processes_train_like_one_with_the_same_global_batch(
    tmp_path: Path, mode: str, lora: dict | None, extra: dict
) -> None:
    """Same losses and the same final adapter as one process with the same global batch. Under FSDP2 the
    adapter's factors are sharded over the two ranks, so an export that saved one rank's shards would differ;
    with an NF4 base, FSDP2 shards the packed NF4 weights themselves (TorchAO's NF4 tensor shards by rows)."""
    _ok(
        _launch(
            ["run", str(_config(tmp_path, "ddp", lora, batch_size=2, distributed=mode, **extra))], nproc=2
        )
    )
    _ok(_launch(["run", str(_config(tmp_path, "one", lora, batch_size=4, **extra))], nproc=None))
    assert_trains_like_one_process(tmp_path / "ddp", tmp_path / "one")
    peft_got, peft_want = (
        load_file(tmp_path / run / "adapter_peft" / PEFT_WEIGHTS) for run in ("ddp", "one")
    )
    assert peft_got.keys() == peft_want.keys() and peft_want
    for name in peft_want:
        torch.testing.assert_close(
            peft_got[name], peft_want[name], rtol=10 * RTOL, atol=1e-6, msg=f"PEFT {name}"
        )
    summary = json.loads((tmp_path / "ddp" / "run_summary.json").read_text())
    assert summary["steps"] == 6


def test_accelerate_launch_trains_like_torchrun(tmp_path: Path) -> None:
    """``accelerate launch`` (what many users type) starts the same DDP run: the same losses as one process."""
    pytest.importorskip("accelerate")
    _ok(
        _launch(
            ["run", str(_config(tmp_path, "acc", batch_size=2, max_steps=3))], nproc=2, launcher="accelerate"
        )
    )
    _ok(_launch(["run", str(_config(tmp_path, "one", batch_size=4, max_steps=3))], nproc=None))
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "acc")), torch.tensor(losses(tmp_path / "one")), rtol=RTOL, atol=0
    )


@pytest.mark.parametrize(
    "extra",
    [{}, {"gradient_checkpointing": True, "layer_offloading": True}],
    ids=["plain", "layer-offloading"],
)
def test_two_processes_train_a_gptq_checkpoint_like_one(tmp_path: Path, extra: dict) -> None:
    """A GPTQ checkpoint (read by loralei one layer at a time, its linears kept as stored) trains under DDP as in
    one process with the same global batch; with layer offloading too (its stored tensors stream per layer)."""
    write_checkpoint(tmp_path / "gptq", "gptq")
    lora = {"target_modules": ["q_proj", "v_proj", "down_proj"]}
    for name, nproc, extra in (
        ("ddp", 2, {"batch_size": 2, "distributed": "ddp"}),
        ("one", None, {"batch_size": 4}),
    ):
        path = _config(tmp_path, name, lora, **extra)
        raw = json.loads(path.read_text())
        path.write_text(
            json.dumps(raw | {"model": {"name_or_path": str(tmp_path / "gptq"), "dtype": "float32"}})
        )
        _ok(_launch(["run", str(path), "--load"], nproc=nproc))
    got, want = losses(tmp_path / "ddp"), losses(tmp_path / "one")
    assert len(got) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)


@pytest.mark.parametrize(("mode", "reducer"), [("ddp", "fp32_sum_hook"), ("fsdp2", "reduce_gradients")])
def test_unequal_token_counts_are_normalised_over_all_ranks(tmp_path: Path, mode: str, reducer: str) -> None:
    """The reduced gradients equal one process's gradients of both ranks' rows: DDP sums through its FP32 hook
    (not DDP's own average), FSDP2 through the engine's FP32 all-reduce of the replicated factors."""
    out = tmp_path / "grads.pt"
    _ok(_launch(["grads", str(out), "--mode", mode], nproc=2))
    saved = torch.load(out, map_location="cpu")
    assert saved["hook"].endswith(reducer), saved["hook"]
    if (
        mode == "fsdp2"
    ):  # sharded: the layers' frozen weights and the input embedding; whole: LoRA, head, norm
        sharded = saved["sharded"]
        assert all(n.startswith(("model.layers.", "model.embed_tokens.")) for n in sharded), sharded
        assert not any("lora_" in n for n in sharded), sharded
        assert "model.embed_tokens.weight" in sharded and "model.layers.0.self_attn.q_proj.weight" in sharded
        # each unit's forward starts the next unit's gather (the last has none to start)
        layers = sorted(
            (n for n in saved["prefetch"] if n.startswith("model.layers.")),
            key=lambda n: int(n.split(".")[-1]),
        )
        units = ["model.embed_tokens", *layers]
        assert units[1:] and set(units) <= saved["prefetch"].keys(), saved["prefetch"]
        for unit, following in zip(units, [*units[1:], None], strict=True):
            assert saved["prefetch"][unit] == ([following] if following else []), (unit, saved["prefetch"])
    reduced = saved["grads"]
    model = lora_model()
    objs = Trainables(model, optimizer=None, scheduler=None)
    window = unequal_window(0) + unequal_window(1)  # the union, as one process's accumulation window
    _forward_backward(
        objs,
        window,
        cross_entropy_loss,
        LoopSettings(1, len(window), None, 1, None, None, 3, torch.device("cpu")),
    )
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert reduced.keys() == expected.keys() and expected
    for name, grad in expected.items():
        torch.testing.assert_close(reduced[name], grad, rtol=RTOL, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    ("mode", "lora", "extra"),
    [("ddp", None, {}), ("fsdp2", None, {}), ("fsdp2", DORA, {"gradient_checkpointing": True})],
    ids=["ddp", "fsdp2", "fsdp2-dora-checkpointing"],
)
def test_kill_and_resume_equals_the_uninterrupted_run(
    tmp_path: Path, mode: str, lora: dict | None, extra: dict
) -> None:
    """The checkpoint (torch.distributed.checkpoint: under FSDP2 each rank's shards of the factors, of DoRA's
    magnitudes and of the optimizer state) brings back everything: the rest of the run repeats the uninterrupted
    one bit for bit."""
    # dropout on: every rank's RNG state must come back from the checkpoint for the masks to repeat
    settings = {"batch_size": 2, "dropout": 0.1, "save_steps": 2, "distributed": mode, **extra}
    full = _config(tmp_path, "full", lora, **settings)
    cut = _config(tmp_path, "cut", lora, **settings)
    _ok(_launch(["run", str(full)], nproc=2))
    crashed = _launch(["run", str(cut), "--crash-after", "4"], nproc=2)
    assert crashed.returncode != 0 and f"exitcode  : {EXIT_CRASHED}" in crashed.stderr, crashed.stderr[-4000:]
    raw = json.loads(cut.read_text())
    raw["training"]["resume_from_checkpoint"] = True
    cut.write_text(json.dumps(raw))
    _ok(_launch(["run", str(cut)], nproc=2))
    assert losses(tmp_path / "cut")[-2:] == losses(tmp_path / "full")[-2:]
    got, want = adapter_tensors(tmp_path / "cut" / "adapter"), adapter_tensors(tmp_path / "full" / "adapter")
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_one_failing_rank_ends_the_job(tmp_path: Path) -> None:
    """Rank 1 fails at step 2 while rank 0 trains on: torchrun ends the job (no wait for a collective's
    timeout) and names rank 1 as the root cause."""
    config = _config(tmp_path, "fail", batch_size=2, max_steps=50)
    proc = _launch(["run", str(config), "--crash-after", "2", "--crash-rank", "1"], nproc=2)
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "rank      : 1" in root_cause and f"exitcode  : {EXIT_CRASHED}" in root_cause, proc.stderr[-3000:]


def test_a_rank_killed_mid_step_ends_the_job_within_a_minute(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed inside a forward while rank 0 waits for it in the step's gradient reduction: the
    job ends within a minute (not at the collective's 30-minute timeout) and the launcher's report names rank 1
    and the signal."""
    config = _config(tmp_path, "killed", batch_size=2, max_steps=50)
    start = time.monotonic()
    proc = _launch(["run", str(config), "--kill-after", "2", "--crash-rank", "1"], nproc=2)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "rank      : 1" in root_cause and "SIGKILL" in root_cause, proc.stderr[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"


# --- launch checks (no processes) ---

TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize(
    ("mode", "env", "expected"),
    [
        ("auto", {}, launch.Launch("none")),
        ("auto", TORCHRUN, launch.Launch("ddp", 0, 0, 2)),
        ("auto", {**TORCHRUN, "WORLD_SIZE": "1"}, launch.Launch("none")),
        ("ddp", {**TORCHRUN, "WORLD_SIZE": "1"}, launch.Launch("ddp", 0, 0, 1)),
        ("fsdp2", TORCHRUN, launch.Launch("fsdp2", 0, 0, 2)),
        ("none", {**TORCHRUN, "WORLD_SIZE": "1"}, launch.Launch("none")),
    ],
)
def test_launch_modes(mode: str, env: dict, expected: launch.Launch) -> None:
    assert launch.read_launch(mode, env) == expected


@pytest.mark.parametrize(
    ("mode", "env", "message"),
    [
        ("ddp", {}, "training.distributed: ddp needs processes started by torchrun"),
        ("fsdp2", {}, "training.distributed: fsdp2 needs processes started by torchrun"),
        ("auto", {"WORLD_SIZE": "2"}, "sets WORLD_SIZE but not RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        ("none", TORCHRUN, "training.distributed: none, but torchrun started 2 processes"),
    ],
)
def test_misconfigured_launches_are_named(mode: str, env: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        launch.read_launch(mode, env)


def test_fsdp2_refuses_a_merged_export(tmp_path: Path) -> None:
    from loralei.train.schema import validate_config
    from loralei.train.setup import check_fsdp2

    cfg = validate_config(
        json.loads(_config(tmp_path, "x", distributed="fsdp2", save_merged=True).read_text())
    )
    with pytest.raises(
        ConfigError, match=r"training\.save_merged: true is not supported with distributed: fsdp2"
    ):
        check_fsdp2(cfg)


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_fsdp2_refuses_int4_and_fp8_bases(tmp_path: Path, kind: str) -> None:
    from loralei.train.schema import validate_config
    from loralei.train.setup import check_fsdp2

    lora = {"quantize_base": True, "quantization_type": kind}
    cfg = validate_config(json.loads(_config(tmp_path, "x", lora, distributed="fsdp2").read_text()))
    with pytest.raises(ConfigError, match=rf"lora\.quantization_type: '{kind}' bases are not supported with"):
        check_fsdp2(cfg)
