"""Sequence parallelism (Ulysses) on the CPU: two gloo processes, each with half of every row, give the loss and
the LoRA gradients of one process with the whole rows, and the runner trains like one process; the shards'
layout; the settings it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sequence_parallel_worker import batch, lora_grads, lora_model
from test_ddp import _config, _ok, assert_trains_like_one_process
from test_ddp import _launch as _launch_runner

from loralei.errors import ConfigError
from loralei.train import launch, sequence_parallel
from loralei.train.losses import IGNORE_INDEX, SHIFTED, build_loss, count_trainable_tokens, trainable_labels
from loralei.train.schema import validate_config

WORKER = Path(__file__).resolve().parent / "sequence_parallel_worker.py"
SRC = Path(__file__).resolve().parents[2] / "src"


def _launch(out: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in launch.TORCHRUN_VARIABLES}
    env |= {"PYTHONPATH": os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    env |= {"GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(out), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize(
    ("kv_heads", "loss", "fused"),
    [(2, "cross_entropy", False), (1, "cross_entropy", False), (2, "linear_cross_entropy", True)],
    ids=["kv-heads-split", "kv-heads-repeated", "fused-linear-cross-entropy"],
)
def test_two_ranks_per_sequence_give_the_loss_and_gradients_of_one_process(
    tmp_path: Path, kv_heads: int, loss: str, fused: bool
) -> None:
    """fp32: the runs differ only in the order of sums (1e-5 relative, far below what a lost cross-shard target,
    a wrong position or a missing exchange gradient moves)."""
    _launch(tmp_path / "sp.pt", str(kv_heads), loss, "1" if fused else "0")
    got = torch.load(tmp_path / "sp.pt")
    model, whole = lora_model(kv_heads, fused), batch()
    count = count_trainable_tokens(whole)
    want = build_loss(loss, liger=False)(model, whole, trainable_labels(whole), count)
    want.backward()
    torch.testing.assert_close(got["loss"], want.detach(), rtol=1e-5, atol=0)
    grads = lora_grads(model)
    assert got["grads"].keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_shards_cut_each_row_after_the_shift_and_pad_it_on_the_right() -> None:
    whole = batch()
    shards = [sequence_parallel.shard_batch(whole, i, 2) for i in range(2)]
    assert all(s["input_ids"].shape == (2, 12) for s in shards)  # 23 tokens padded to 24
    ids = torch.cat([s["input_ids"] for s in shards], 1)
    assert torch.equal(ids[:, :23], whole["input_ids"]) and not ids[:, 23].any()
    assert torch.equal(torch.cat([s["position_ids"] for s in shards], 1), torch.arange(24).expand(2, 24))
    targets = torch.cat([s[SHIFTED] for s in shards], 1)
    # position 11 (rank 0's last) predicts token 12 (rank 1's first)
    assert targets[0, 11] == whole["labels"][0, 12]
    assert (targets[:, 22:] == IGNORE_INDEX).all() and (targets[1, 16:] == IGNORE_INDEX).all()
    assert sum(count_trainable_tokens(s) for s in shards) == count_trainable_tokens(whole)


def test_a_model_whose_heads_the_ranks_do_not_divide_is_refused() -> None:
    config = lora_model(2, False).config  # 4 heads
    assert sequence_parallel.refusal(config, 2, "sdpa") is None
    assert "does not divide this model's 4 attention heads" in sequence_parallel.refusal(config, 3, "sdpa")
    assert "set model.attn_implementation: sdpa" in sequence_parallel.refusal(config, 2, "eager")


def test_a_world_the_group_size_does_not_divide_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(sequence_parallel.distributed, "world_size", lambda: 3)
    with pytest.raises(ConfigError, match=r"sequence_parallel_size: 2 does not divide the 3 processes"):
        sequence_parallel.new_group(2)


@pytest.mark.parametrize(("processes", "batch_size"), [(2, 4), (4, 2)], ids=["one-group", "two-groups-ddp"])
def test_the_runner_with_two_ranks_per_sequence_trains_like_one_process(
    tmp_path: Path, processes: int, batch_size: int
) -> None:
    """torchrun, ``sequence_parallel_size: 2``: 2 processes (one group, both ranks read every batch), or 4 (two
    groups, DDP between them, each reading half of every global batch): the same losses and the same final
    adapter as one process with the same global batches."""
    sp = _config(tmp_path, "sp", batch_size=batch_size, sequence_parallel_size=2)
    proc = _launch_runner(["run", str(sp)], nproc=processes)
    _ok(proc)
    # what the run says (each rank holding the whole rows would train alike, but not split anything)
    groups = processes // 2
    assert "each sequence split over 2 ranks (Ulysses" in proc.stdout + proc.stderr
    assert f"{groups} data-parallel group(s)" in proc.stdout + proc.stderr
    _ok(_launch_runner(["run", str(_config(tmp_path, "one", batch_size=4))], nproc=None))
    assert_trains_like_one_process(tmp_path / "sp", tmp_path / "one")


def test_settings_a_sequence_parallel_run_cannot_take_are_refused_together() -> None:
    raw = {
        "model": {"name_or_path": "m", "attn_implementation": "eager"},
        "data": {"path": "d"},
        "output_dir": "o",
        "training": {
            "sequence_parallel_size": 2,
            "packing": True,
            "liger_kernel": True,
            "distributed": "fsdp2",
        },
    }
    with pytest.raises(ConfigError) as err:
        validate_config(raw)
    for fix in (
        "sequence_parallel_size: 2 does not run with packing: true",
        "set liger_kernel: auto or false",
        "distributed: fsdp2 (it runs under DDP over all ranks)",
        "attn_implementation: eager (it wraps sdpa or flash_attention_2); set it to sdpa",
    ):
        assert fix in str(err.value)


def test_validate_says_each_sequence_is_split(monkeypatch, capsys) -> None:
    from loralei import cli

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    argv = [
        "validate",
        "examples/quickstart.yaml",
        "training.sequence_parallel_size=2",
        "training.packing=false",
    ]
    assert cli.main(argv) == 0
    assert "sequence parallelism: each sequence split over 2 ranks under torchrun" in capsys.readouterr().out
