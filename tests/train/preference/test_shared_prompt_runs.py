"""``preference.share_prompt`` in the runner: ``auto`` stores each pair's prompt once where the run can, and says
why not elsewhere; ``true`` is refused with the reason before anything runs; a run so stored trains as the
unshared one (the same logged losses and metrics, the same adapter), without checkpointing and with each
checkpointing mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pair_helpers import collate, make_pairs

from launching import child_env
from loralei.errors import ConfigError
from loralei.train import shared_prompt
from loralei.train.data import make_collator
from loralei.train.data.preference_collate import PreferenceCollator
from loralei.train.losses import PAIR_MAPS
from loralei.train.metrics import read_log
from loralei.train.schema import validate_config
from saved_adapter import saved_adapter
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart-dpo.yaml"
BASE = {"model": {"name_or_path": "m"}, "data": {"path": "d"}, "output_dir": "out"}


def config(training: dict | None = None, preference: dict | None = None):
    training = {"objective": "dpo", **(training or {})}
    sections = {} if training["objective"] == "sft" else {"preference": preference or {}}
    return validate_config({**BASE, "training": training, **sections})


def pairs_collate() -> PreferenceCollator:
    base = make_collator(0, max_seq_length=64, pad_to_max_length=False, packed=False, attention_mask=True)
    return PreferenceCollator(base)


def test_calls_without_pair_rows_run_the_models_own_attention() -> None:
    """After the switch, a batch of ordinary rows (padded, as generation after training makes them) gets the
    model's own sdpa attention and mask: the same logits."""
    model = tiny_model()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        shared_prompt.enable(model)
        got = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == shared_prompt.NAME
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=0, atol=0)


def test_a_model_whose_attention_never_reads_the_pair_rows_is_stopped() -> None:
    """A forward of a shared-prompt batch whose attention calls get no pair rows (a family whose attention module
    does not pass its keyword arguments on) would let the rejected completions see the chosen ones: refused."""
    model = tiny_model()
    shared_prompt.enable(model)
    batch = collate(make_pairs(2, seed=0), packed=False, share=True)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        with pytest.raises(ConfigError, match=r"never received the batch's pair rows.*share_prompt: false"):
            shared_prompt.checked_forward(lambda: model.base_model(**inputs), batch)
        rows = {key: batch[key] for key in PAIR_MAPS}
        shared_prompt.checked_forward(lambda: model.base_model(**inputs, **rows), batch)
        shared_prompt.checked_forward(lambda: model.base_model(**inputs), inputs)  # not a shared batch


def test_auto_stores_prompts_once_where_the_run_can() -> None:
    model = tiny_model()
    collate, note = shared_prompt.resolve(config(), model, pairs_collate(), own_batches=False)
    assert collate.share_prompt and collate.base.max_seq_length == 2 * 2048  # a row holds both sequences
    assert model.config._attn_implementation == shared_prompt.NAME
    assert note == [
        "preference.share_prompt: auto -> on: each pair's prompt stored and run once; attention over each pair's "
        "two sequences as they read"
    ]


@pytest.mark.parametrize(
    ("training", "family", "own", "why"),
    [
        ({"pad_to_max_length": True}, "llama", False, "rows padded to one width"),
        ({"cuda_graphs": True}, "llama", False, "CUDA graphs replay rows of one width"),
        ({"torch_compile": True}, "llama", False, "training.torch_compile"),
        ({}, "llama", True, "the batches are the caller's"),
        ({"attn_implementation": "eager"}, "llama", False, "it runs sdpa attention, not eager"),
        ({}, "gemma2", False, "the model runs eager attention, not sdpa"),
        ({"max_seq_length": 64}, "llama", False, None),
    ],
)
def test_auto_says_why_it_leaves_the_rows_unshared(training, family, own, why) -> None:
    model = tiny_model(family)
    collate = pairs_collate()
    got, note = shared_prompt.resolve(config(training), model, collate, own_batches=own)
    if why is None:
        assert got.share_prompt
        return
    assert got is collate and not got.share_prompt and model.config._attn_implementation != shared_prompt.NAME
    assert len(note) == 1 and note[0].startswith("preference.share_prompt: auto -> off: ") and why in note[0]


def test_a_sliding_window_shorter_than_the_sequences_keeps_them_unshared() -> None:
    model = tiny_model("mistral", sliding_window=32)
    assert "sliding-window layers (32 tokens)" in shared_prompt.model_refusal(model, 64)
    assert shared_prompt.model_refusal(model, 32) is None


@pytest.mark.parametrize("objective", ["sft", "kto"])
def test_objectives_without_pairs_are_left_alone(objective: str) -> None:
    collate, cfg = object(), config({"objective": objective, "batch_size": 2})
    assert shared_prompt.resolve(cfg, tiny_model(), collate, False) == (collate, [])


def test_false_leaves_the_rows_unshared_without_a_note() -> None:
    collate = pairs_collate()
    assert shared_prompt.resolve(
        config(preference={"share_prompt": False}), tiny_model(), collate, False
    ) == (
        collate,
        [],
    )


def test_true_where_the_run_cannot_is_refused_with_the_reason() -> None:
    with pytest.raises(
        ConfigError, match=r"preference\.share_prompt: true cannot run here: rows padded .*auto"
    ):
        config({"pad_to_max_length": True}, {"share_prompt": True})
    cfg = config(preference={"share_prompt": True})
    with pytest.raises(
        ConfigError, match=r"preference\.share_prompt: true cannot run here: the model runs eager"
    ):
        shared_prompt.resolve(cfg, tiny_model("gemma2"), pairs_collate(), own_batches=False)
    with pytest.raises(ConfigError, match=r"preference\.share_prompt: .* is read by training\.objective dpo"):
        config({"objective": "kto", "batch_size": 2}, {"share_prompt": True})


def test_cuda_graphs_auto_gives_way_to_share_prompt_true() -> None:
    """On a CUDA device, ``share_prompt: true`` is a reason for ``cuda_graphs: auto`` to stay off."""
    from loralei.train.fast_path import _graphs_refusal

    cuda = type("Device", (), {"type": "cuda"})()  # the device check passed; nothing else reads it first
    why = _graphs_refusal(config(preference={"share_prompt": True}), tiny_model(), cuda, distributed=False)
    assert why == "preference.share_prompt: true stores each pair in a row of its own width"


def _run(tmp_path: Path, name: str, *overrides: str) -> Path:
    """The DPO quickstart, graphs off (on a GPU they would take the rows), 12 steps."""
    out = tmp_path / name
    args = [
        sys.executable, "-m", "loralei.cli", str(QUICKSTART), f"output_dir={out}", "training.cuda_graphs=false",
        "training.max_steps=12", "training.logging_steps=3", "training.report_to=none", *overrides,
    ]  # fmt: skip
    proc = subprocess.run(args, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.mark.parametrize(
    ("checkpointing", "packing"),
    [("false", "false"), ("true", "false"), ("offload", "false"), ("false", "true")],
)
def test_a_run_with_prompts_stored_once_trains_as_the_unshared_run(
    tmp_path: Path, checkpointing: str, packing: str
) -> None:
    """The DPO quickstart, 12 steps: ``auto`` stores the prompts once (the run's notes say so) and logs the
    unshared run's losses and metrics; the adapters agree (the FP32 token sums run in another order)."""
    mode = (f"training.gradient_checkpointing={checkpointing}", f"training.packing={packing}")
    shared = _run(tmp_path, "shared", *mode)
    plain = _run(tmp_path, "plain", *mode, "preference.share_prompt=false")
    notes = json.loads((shared / "run_summary.json").read_text())["setup_notes"]
    assert any(note.startswith("preference.share_prompt: auto -> on") for note in notes), notes
    got, want = ([r for r in read_log(out) if "loss" in r] for out in (shared, plain))
    assert len(got) == len(want) == 4
    for key in KEYS:
        torch.testing.assert_close(
            torch.tensor([r[key] for r in got]), torch.tensor([r[key] for r in want]), rtol=1e-4, atol=1e-5
        )
    adapters = [saved_adapter(out / "adapter") for out in (shared, plain)]
    for name, tensor in adapters[1].items():
        torch.testing.assert_close(adapters[0][name], tensor, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpointing", ["false", "offload"])
def test_on_the_gpu_a_run_with_prompts_stored_once_trains_as_the_unshared_run(
    tmp_path, checkpointing
) -> None:
    """The same on CUDA (the fused kernels, sdpa's flash or cuDNN kernel over the virtual rows), graphs off so that
    ``auto`` stores the prompts once."""
    test_a_run_with_prompts_stored_once_trains_as_the_unshared_run(tmp_path, checkpointing, "false")
