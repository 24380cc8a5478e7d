"""Preference objectives with each sequence split over two processes (``training.sequence_parallel_size: 2``, gloo
on the CPU, one group, so both ranks read every batch): each rank sums its shard's token log-probabilities per
sequence, the sums are added over the group (differentiably), and both ranks compute the pair loss from the whole
sums. The run logs the one-process run's losses, preference metrics and evaluation losses and saves its adapter,
within the summation-order tolerance (the one process's prompts run twice too: ``share_prompt`` off in both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_dpo_ddp import (
    CONFIG,
    EVALUATION,
    KTO,
    RTOL,
    _dpo,
    _evaluated,
    _logged,
    _series,
)

from loralei.train import sequence_parallel
from saved_adapter import saved_adapter
from tolerances import assert_fp32_close


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        (CONFIG, ()),
        (CONFIG, ("preference.precompute_reference=true", "training.packing=false", *EVALUATION)),
        (CONFIG, ("training.objective=orpo",)),
        (KTO, EVALUATION),
    ],
    ids=["dpo-packed", "dpo-precomputed-reference-unpacked-evaluated", "orpo", "kto-evaluated"],
)
def test_two_ranks_per_sequence_train_preference_objectives_like_one_process(
    tmp_path: Path, config: Path, overrides: tuple[str, ...]
) -> None:
    overrides = (*overrides, *(("preference.share_prompt=false",) if config == CONFIG else ()))
    split = _dpo(
        tmp_path, "sp", 2, 4, config=config, overrides=(*overrides, "training.sequence_parallel_size=2")
    )
    one = _dpo(tmp_path, "one", None, 4, config=config, overrides=overrides)
    notes = json.loads((split / "run_summary.json").read_text())["setup_notes"]
    assert any(note.startswith("sequence parallelism: each sequence split over 2 ranks") for note in notes)
    got, want = _logged(split), _logged(one)
    assert len(got) == len(want) == 4
    for step, (record, expected) in enumerate(zip(got, want, strict=True), 1):
        assert record.keys() == expected.keys()
        keys = [key for key in expected if key.startswith(("loss", "logps/", "logits/", "kl", "nll"))]
        assert "loss" in keys and any(key.startswith("logps/") for key in keys)
        for key in keys:
            torch.testing.assert_close(
                record[key], expected[key], rtol=RTOL, atol=1e-6, msg=f"{key} at step {step}"
            )
    if "training.eval_steps=2" in overrides:
        evaluated = [_series(_evaluated(run), "eval_loss") for run in (split, one)]
        assert len(evaluated[1]) == 2
        torch.testing.assert_close(*evaluated, rtol=RTOL, atol=0)
    got, want = (saved_adapter(out / "adapter") for out in (split, one))
    assert got.keys() == want.keys() and want
    for name, tensor in want.items():  # norm-wise: see tests/train/test_ddp.assert_trains_like_one_process
        assert_fp32_close(got[name], tensor, name, tolerance=10 * RTOL)


def test_a_shard_carries_its_targets_sequences_and_the_whole_pairs() -> None:
    """Each position's sequence id is shifted with its target (the sequence of the token it predicts) and cut
    with it; the pairs' dataset indices and KTO's labels are whole on every rank."""
    ids = torch.arange(10, 17).unsqueeze(0)
    batch = {
        "input_ids": ids,
        "labels": ids.clone(),
        "sequence_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1]]),
        "pair_ids": torch.tensor([7]),
        "desirable": torch.tensor([True]),
    }
    shards = [sequence_parallel.shard_batch(batch, i, 2) for i in range(2)]
    assert [s["sequence_ids"].tolist() for s in shards] == [[[0, 0, 1, 1]], [[1, 1, -100, -1]]]
    assert all(s["pair_ids"].tolist() == [7] and s["desirable"].tolist() == [True] for s in shards)
