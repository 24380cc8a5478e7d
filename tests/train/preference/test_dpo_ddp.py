"""DPO (then KTO, its z shared by the ranks, and both under FSDP2) with several processes: two processes (gloo on
the CPU) train the DPO quickstart under DDP like one process with the same global batch of pairs: the same logged
losses and preference metrics (averaged over both ranks' pairs), the same final adapter. The reference pass
(adapter off, no autograd) runs inside DDP's forward on each rank.

Two one-process twins: one batch of the step's 4 pairs, and two micro-batches of 2 (gradient accumulation) as the
ranks take them. The second differs from DDP only in how the halves' sums meet (accumulation or an all-reduce; on
an AVX-512 Xeon, and on its AVX2 kernels, not at all): the logs and the adapter match it at the strict tolerances.
The first rounds otherwise, being padded and packed otherwise: its logs match within what rounding leaves them
(rewards: see the test), and the adapter is not compared with it. Adam gives every adapter element a step near
the learning rate whatever the size of its gradient, so an element with small gradients carries their rounding
into the adapter at about lr times their relative error: against one batch of 4, 2 of the adapter's 67,584
elements differed by up to 2.2 times the adapters' tolerance (AVX-512; 1.3 times on the AVX2 kernels), and one
batch of 4 on the AVX-512 kernels and on the AVX2 kernels by up to 14 times: rounding, not DDP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from launching import child_env
from loralei.train.metrics import read_log
from saved_adapter import saved_adapter

ROOT = Path(__file__).resolve().parents[3]
RTOL = 1e-5  # as tests/train/test_ddp.py: the runs differ only in the order of floating-point sums
CONFIG = ROOT / "examples" / "quickstart-dpo.yaml"
KTO = ROOT / "examples" / "quickstart-kto.yaml"


def _dpo(
    tmp_path: Path,
    name: str,
    nproc: int | None,
    batch_size: int,
    accumulation: int = 1,
    config: Path = CONFIG,
    distributed: str = "ddp",
    overrides: tuple[str, ...] = (),
) -> Path:
    """The DPO quickstart (or ``config``) for 4 steps, logging each, in ``nproc`` processes (None: one plain
    process) under ``distributed``, each step ``accumulation`` micro-batches of ``batch_size`` pairs (examples)
    per process; ``overrides``: more ``key=value`` settings."""
    out = tmp_path / name
    runner = [sys.executable]
    if nproc is not None:
        runner += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    args = [
        "-m", "loralei.cli", str(config), f"output_dir={out}",
        "training.max_steps=4", "training.logging_steps=1", f"training.batch_size={batch_size}",
        f"training.gradient_accumulation_steps={accumulation}", "training.report_to=none",
        "optimizer.warmup_steps=1",
        *([f"training.distributed={distributed}"] if nproc else []), *overrides,
    ]  # fmt: skip
    proc = subprocess.run(
        [*runner, *args], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _assert_same_adapter(got: Path, want: Path) -> None:
    """The runs' saved adapters hold the same tensors, each element within the summation-order tolerance."""
    adapters = [saved_adapter(out / "adapter") for out in (got, want)]
    assert adapters[1].keys() == adapters[0].keys() and adapters[1]
    for name, want_t in adapters[1].items():
        torch.testing.assert_close(adapters[0][name], want_t, rtol=10 * RTOL, atol=1e-6, msg=name)


def _evaluated(out: Path) -> list[dict]:
    return [r for r in read_log(out) if "eval_loss" in r]


def _logged(out: Path) -> list[dict]:
    return [r for r in read_log(out) if "loss" in r]


def _series(records: list[dict], key: str) -> torch.Tensor:
    """``key``'s logged values, step by step, in FP64."""
    return torch.tensor([r[key] for r in records], dtype=torch.float64)


def test_two_processes_train_dpo_like_one_with_the_same_global_batch(tmp_path: Path) -> None:
    two = _dpo(tmp_path, "ddp", 2, 2)
    one, accumulated = _dpo(tmp_path, "one", None, 4), _dpo(tmp_path, "accumulated", None, 2, accumulation=2)
    got, want, micro = _logged(two), _logged(one), _logged(accumulated)
    assert len(got) == len(want) == len(micro) == 4
    rewards = ("rewards/chosen", "rewards/rejected", "rewards/margins")
    keys = (
        "loss",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    )
    for key in (*rewards, *keys):
        torch.testing.assert_close(_series(got, key), _series(micro, key), rtol=RTOL, atol=1e-7, msg=key)
    for key in keys:
        torch.testing.assert_close(_series(got, key), _series(want, key), rtol=RTOL, atol=1e-7, msg=key)
    # A reward is β(π - π_ref): the difference of two summed log-probabilities (about -118 here, where an FP32 ulp
    # is 7.6e-6) cancels most of their digits, so against one batch of 4 the rewards do not agree to RTOL of
    # themselves. With π and π_ref each agreeing to RTOL, as logps/* do, a reward may differ by
    # β·RTOL·(|π| + |π_ref|), per step: 2.4e-4 at step 2, where rewards/chosen (0.0064) differed by 9.5e-7. π is
    # logps/* and π_ref = π - reward/β, both means over the pairs of log-probabilities < 0 (so the |·| of the
    # means are the means of the |·|); a margin, the difference of its two rewards, by their two tolerances' sum.
    beta = yaml.safe_load(CONFIG.read_text())["preference"]["beta"]
    atol = {}
    for side in ("chosen", "rejected"):
        logps, reward = _series(want, f"logps/{side}"), _series(want, f"rewards/{side}")
        atol[side] = beta * RTOL * (logps.abs() + (logps - reward / beta).abs())
    atol["margins"] = atol["chosen"] + atol["rejected"]
    for side, tolerances in atol.items():
        key = f"rewards/{side}"
        steps = zip(_series(got, key), _series(want, key), tolerances.tolist(), strict=True)
        for step, (value, expected, tolerance) in enumerate(steps, 1):
            torch.testing.assert_close(
                value, expected, rtol=RTOL, atol=tolerance, msg=f"{key} at step {step}"
            )
    _assert_same_adapter(two, accumulated)
    assert json.loads((two / "run_summary.json").read_text())["steps"] == 4


def test_two_processes_train_kto_with_one_kl_estimate_over_both_micro_batches(tmp_path: Path) -> None:
    """KTO: each rank's micro batch of 2 examples makes its own KL sequences, as the one process's two accumulated
    micro batches do (the same examples, taken as the ranks take them), but z is the mean of both ranks'
    estimates before the clamp (TRL's gathered one), where the one process clamps each micro batch's own. At
    step 1 (a zero adapter, z 0 everywhere) the runs log the same. The logged ``kl`` is the mean z: the clamp of
    the ranks' mean is at most the mean of their clamps, and below it where one rank's estimate is negative and
    the other's positive (step 3 of this run: 0 against 0.094). Each rank keeping its own z logs the one process's.
    tests/train/preference/test_kto.py checks the loss with a shared z against the definition."""
    two = _dpo(tmp_path, "ddp", 2, 2, config=KTO)
    accumulated = _dpo(tmp_path, "accumulated", None, 2, accumulation=2, config=KTO)
    got, want = _logged(two), _logged(accumulated)
    assert len(got) == len(want) == 4
    for key in ("loss", "kl", "logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        torch.testing.assert_close(_series(got, key)[0], _series(want, key)[0], rtol=RTOL, atol=1e-6, msg=key)
    shared, own = _series(got, "kl"), _series(want, "kl")
    assert (shared <= own + 1e-6).all() and (shared < own - 1e-2).any(), (shared, own)


# the last 10 pairs (examples) held out and evaluated every 2 steps: one pair a packed row here, so 10 rows in
# global batches of 2 × 2, the last of which leaves rank 1 none
EVALUATION = ("data.split=train[:290]", "data.eval_split=train[290:300]", "training.eval_steps=2")


@pytest.mark.parametrize(
    ("config", "reference"),
    [(CONFIG, None), (CONFIG, "precompute"), (CONFIG, "adapter"), (KTO, None)],
    ids=["dpo", "dpo-precomputed-reference", "dpo-reference-adapter", "kto"],
)
def test_fsdp2_trains_and_evaluates_preference_objectives_as_ddp(
    tmp_path: Path, config: Path, reference: str | None
) -> None:
    """FSDP2 shards the frozen base over the ranks; the LoRA factors, and a reference adapter swapped into them,
    stay whole on every rank: the same logged losses, preference metrics and evaluation losses as DDP (which
    trains like one process, above), and the same adapter. Rank 1 has no batch in the evaluation's last global
    batch: it runs a filler, or rank 0's forward would wait for ever on its weight gathers."""
    overrides = EVALUATION
    if reference == "precompute":
        overrides += ("preference.precompute_reference=true",)
    if reference == "adapter":
        start = _dpo(tmp_path, "start", None, 4)  # a trained adapter: the reference the policy starts from
        overrides += (f"preference.reference={start / 'adapter'}",)
    ddp, fsdp2 = (
        _dpo(tmp_path, mode, 2, 2, config=config, distributed=mode, overrides=overrides)
        for mode in ("ddp", "fsdp2")
    )
    got, want = _logged(fsdp2), _logged(ddp)
    assert len(got) == len(want) == 4
    for step, (record, expected) in enumerate(zip(got, want, strict=True), 1):
        assert record.keys() == expected.keys()  # KTO logs a side's means only where the window has one
        keys = [key for key in expected if key.startswith(("loss", "rewards/", "logps/", "logits/", "kl"))]
        assert "loss" in keys and any(key.startswith("logps/") for key in keys)
        for key in keys:
            torch.testing.assert_close(
                record[key], expected[key], rtol=RTOL, atol=1e-7, msg=f"{key} at step {step}"
            )
    evaluated = [_series(_evaluated(run), "eval_loss") for run in (fsdp2, ddp)]
    assert len(evaluated[1]) == 2  # steps 2 and 4
    torch.testing.assert_close(*evaluated, rtol=RTOL, atol=0)
    _assert_same_adapter(fsdp2, ddp)
