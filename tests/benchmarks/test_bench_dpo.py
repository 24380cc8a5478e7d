"""benchmarks/bench_dpo.py on the CPU: the loralei row (the runner's DPO path, the pairs read from a JSONL file)
trains the tiny shape, every sequence exactly --seq tokens, and the table judges issue 48's bar from the rows."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_dpo
import dpo_table

TINY = ["--shape", "tiny", "--dtype", "float32", "--seq", "32", "--pairs", "2", "--warmup", "1"]


@pytest.mark.parametrize("checkpointing", ["off", "on", "offload"])
def test_the_runner_row_trains_pairs_of_exactly_seq_tokens(tmp_path: Path, checkpointing: str) -> None:
    out = tmp_path / "loralei.json"
    argv = [*TINY, "--steps", "2", "--checkpointing", checkpointing, "--out", str(out)]
    result = bench_dpo.main([*argv, "--model-dir", str(tmp_path / "model")])
    assert json.loads(out.read_text()) == result and "error" not in result
    assert (result["row"], result["checkpointing"], result["reference"]) == (
        "loralei",
        checkpointing,
        "adapter off",
    )
    # 3 steps of 2 pairs, each of two 32-token sequences (8 prompt tokens), none cut or dropped
    assert (
        "6 pairs kept, 0 dropped, 0 truncated to 32 tokens a sequence; 384 tokens, 288 trained"
        in result["data"]
    )
    assert result["tokens_per_s"] == pytest.approx(2 * 2 * 32 / (result["step_ms"] / 1e3))
    assert len(result["host_step_ms"]) == 2 and result["last_loss"] == pytest.approx(0.6931, abs=0.01)
    assert result["adapter"].startswith("r=16 on 14 linear modules")  # 7 projections × 2 layers


def test_the_simpo_row_trains_reference_free_and_is_tabled_unjudged(tmp_path: Path) -> None:
    out = tmp_path / "simpo-loralei-off.json"
    argv = [*TINY, "--steps", "2", "--objective", "simpo", "--out", str(out)]
    result = bench_dpo.main([*argv, "--model-dir", str(tmp_path / "model")])
    assert "error" not in result and (result["objective"], result["reference"]) == (
        "simpo",
        "none (reference-free)",
    )
    assert result["what"].endswith("training.objective: simpo")
    # SimPO (beta 2, gamma 0.5) at a zero adapter: softplus(gamma) = 0.974, plus the chosen tokens' NLL (about ln 256)
    assert result["last_loss"] > 0.974 + 5.0
    text = dpo_table.summary([out], tmp_path / "simpo.md")
    assert text.startswith("# Preference training steps: simpo")
    assert "Issue 48's bar is DPO's: not judged on these rows." in text and "met" not in text


def test_the_kto_row_unpairs_the_pairs_and_starts_at_one_half(tmp_path: Path) -> None:
    """KTO: twice the pairs in examples a step (the batch size), the reference the adapter off, the loss 0.5 at a
    zero adapter; tokens/s counts the examples' tokens (both sequences of every pair, as the other objectives)."""
    out = tmp_path / "kto-loralei-off.json"
    argv = [*TINY, "--steps", "2", "--objective", "kto", "--out", str(out)]
    result = bench_dpo.main([*argv, "--model-dir", str(tmp_path / "model")])
    assert "error" not in result and (result["objective"], result["reference"]) == ("kto", "adapter off")
    assert "6 preference pairs read (each unpaired into its two completions)" in result["data"]
    assert "12 examples (6 desirable, 6 undesirable), 384 tokens" in result["data"]
    assert result["tokens_per_s"] == pytest.approx(2 * 2 * 32 / (result["step_ms"] / 1e3))
    assert result["last_loss"] == pytest.approx(0.5, abs=0.01)
    cfg = bench_dpo.runner_config(
        bench_dpo.parse_args([*argv, "--pairs", "3"]), tmp_path, tmp_path / "d.jsonl", tmp_path
    )
    assert cfg["training"]["batch_size"] == 6 and cfg["preference"]["reference"] == "adapter_off"


def test_the_runner_row_profiles_one_more_step_after_the_timed_ones(tmp_path: Path) -> None:
    profile, out = tmp_path / "profile.json", tmp_path / "dpo.json"
    argv = [*TINY, "--steps", "2", "--profile", str(profile), "--out", str(out)]
    result = bench_dpo.main([*argv, "--model-dir", str(tmp_path / "model")])
    assert "error" not in result and len(result["host_step_ms"]) == 2  # the timed steps' clock unchanged
    summary = json.loads(profile.read_text())
    assert (summary["profiled_step"], summary["profiled_steps"]) == (4, 1)  # 1 warm-up + 2 timed, then it
    assert summary["timed_step_ms"] == pytest.approx(result["step_ms"])
    with pytest.raises(SystemExit):
        bench_dpo.parse_args([*TINY, "--row", "trl-peft", "--profile", "p.json", "--out", "x.json"])


def test_the_runner_row_takes_more_preference_settings(tmp_path: Path) -> None:
    out = tmp_path / "wpo.json"
    argv = [*TINY, "--steps", "1", "--preference", "use_weighting=true", "--preference", "ld_alpha=0.5"]
    result = bench_dpo.main([*argv, "--out", str(out), "--model-dir", str(tmp_path / "model")])
    assert "error" not in result
    assert result["preference"] == {
        "beta": 0.1,
        "loss_type": "sigmoid",
        "reference": "adapter_off",
        "use_weighting": True,
        "ld_alpha": 0.5,
    }
    assert result["last_loss"] < 0.99 * math.log(2)  # ln 2 at the start, times WPO's weights below 1
    for bad in (["--preference", "use_weighting"], ["--row", "trl-peft", "--preference", "ld_alpha=0.5"]):
        with pytest.raises(SystemExit):
            bench_dpo.parse_args([*TINY, *bad, "--out", "x.json"])


def test_the_runner_row_takes_more_training_settings(tmp_path: Path) -> None:
    settings = ["--training", "pad_to_max_length=true", "--training", "cuda_graphs=false"]
    args = bench_dpo.parse_args([*TINY, *settings, "--out", str(tmp_path / "x.json")])
    cfg = bench_dpo.runner_config(args, tmp_path / "model", tmp_path / "pairs.jsonl", tmp_path / "run")
    assert cfg["training"]["pad_to_max_length"] is True and cfg["training"]["cuda_graphs"] is False
    assert cfg["training"]["objective"] == "dpo"
    logged = [*TINY, "--steps", "2", "--training", "logging_steps=1", "--out", str(tmp_path / "x.json")]
    result = bench_dpo.main([*logged, "--model-dir", str(tmp_path / "model")])
    # one loss a step, the first ln 2 (the adapter starts at zero), the last the run's last
    assert len(result["logged_losses"]) == 3 and result["logged_losses"][-1] == result["last_loss"]
    assert result["logged_losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    with pytest.raises(SystemExit):
        bench_dpo.parse_args(
            [*TINY, "--row", "trl-peft", "--training", "cuda_graphs=false", "--out", "x.json"]
        )


def test_pair_rows_are_seeded_and_fill_the_sequence() -> None:
    rows = bench_dpo.pair_rows(256, 3, 32, 8)
    assert rows == bench_dpo.pair_rows(256, 3, 32, 8) and len(rows) == 3
    for row in rows:
        assert len(row["prompt"].split()) == 8 and row["chosen"] != row["rejected"]
        assert [len(row[k].split()) for k in ("chosen", "rejected")] == [23, 23]  # + eos: 32
        assert row["chosen"].startswith(" t") and all(4 <= int(w[1:]) < 256 for w in row["chosen"].split())


def test_a_prompt_that_leaves_no_completion_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench_dpo.parse_args([*TINY, "--prompt-tokens", "31", "--out", "x.json"])


@pytest.mark.parametrize("row", ["trl-peft", "unsloth"])
def test_offload_is_the_runners_mode_only(row: str) -> None:
    with pytest.raises(SystemExit):
        bench_dpo.parse_args([*TINY, "--row", row, "--checkpointing", "offload", "--out", "x.json"])


def _row(row: str, mode: str, speed: float | None, peak: float | None) -> dict:
    return {
        "row": row,
        "checkpointing": mode,
        "tokens_per_s": speed,
        "peak_gib": peak,
        "reference": "adapter off",
    }


def test_the_table_judges_the_bar_per_mode(tmp_path: Path) -> None:
    rows = [
        _row("loralei", "off", 3000.0, 20.0),
        _row("trl-peft", "off", 1900.0, 30.0),
        _row("unsloth", "off", 2400.0, 22.0),
        _row("loralei", "on", 2000.0, 20.0),
        _row("trl-peft", "on", 1400.0, 18.0),
        {**_row("unsloth", "on", None, None), "error": "ImportError: no unsloth"},
    ]
    paths = []
    for i, row in enumerate(rows):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(row))
    text = dpo_table.summary(paths, tmp_path / "dpo.md")
    assert (tmp_path / "dpo.md").read_text() == text
    assert "| trl-peft | off | 1,900 | 30.0 | n/a | adapter off | 1.58x |" in text
    assert "failed: ImportError: no unsloth" in text
    assert (
        "- checkpointing off: 1.58x trl-peft (bar 1.5x), 1.25x unsloth (bar 1.2x), "
        "step peak 20.0 GiB vs unsloth's 22.0 GiB: met" in text
    )
    assert "- checkpointing on: not judged" in text
    offload = [*rows[3:5], _row("unsloth", "on", 1500.0, 17.0), _row("loralei", "offload", 1900.0, 16.0)]
    for i, row in enumerate(offload):
        paths[i].write_text(json.dumps(row))
    text = dpo_table.summary(paths[:4], tmp_path / "dpo.md")  # the runner's offload row against the peers' on
    assert (
        "- checkpointing offload: 1.36x trl-peft (bar 1.5x), 1.27x unsloth (bar 1.2x), "
        "step peak 16.0 GiB vs unsloth's 17.0 GiB: NOT met" in text
    )
    slower = [
        _row("loralei", "off", 2800.0, 20.0),
        _row("trl-peft", "off", 1900.0, 30.0),
        _row("unsloth", "off", 2400.0, 19.0),
    ]
    assert dpo_table.verdict("off", {r["row"]: r for r in slower}).endswith(": NOT met")


def test_a_failed_first_import_fails_the_row_with_its_error(tmp_path: Path, monkeypatch) -> None:
    """The Unsloth row re-executes the script with Unsloth imported first (preimport.py); when that import fails,
    the row's JSON says so instead of a number."""
    monkeypatch.setattr(bench_dpo.preimport, "ERROR", "ModuleNotFoundError importing unsloth: no unsloth")
    out = tmp_path / "row.json"
    result = bench_dpo.main([*TINY, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["tokens_per_s"] is None and "importing unsloth" in result["error"]
    assert "failed: ImportError: ModuleNotFoundError importing unsloth" in dpo_table.summary(
        [out], tmp_path / "t.md"
    )


def test_the_adapter_copy_trl_adds_is_deleted_so_the_reference_is_the_adapter_off() -> None:
    """Handed a PEFT model, TRL adds a frozen copy of its adapter ("ref") and runs the reference with it; the
    Unsloth row deletes it, so its reference passes run with the adapter off, as the other rows' do."""
    from types import SimpleNamespace

    import dpo_peers
    from bench_rows import build_model, peft_config
    from peft import get_peft_model

    model = get_peft_model(build_model("tiny", torch.device("cpu"), torch.float32), peft_config("tiny"))
    trainer = SimpleNamespace(model=model)
    assert dpo_peers.base_as_reference(trainer) is None  # nothing to delete
    model.add_adapter("ref", model.peft_config["default"])
    assert dpo_peers.reference_of(model) == "frozen copy of the adapter ('ref')"
    assert "the reference is the adapter off" in dpo_peers.base_as_reference(trainer)
    assert list(model.peft_config) == ["default"] and dpo_peers.reference_of(model) == "adapter off"
    assert not any(".ref." in name for name, _ in model.named_parameters())
    assert model.active_adapters == ["default"]


class _RewrittenConfig:
    """A TRL config as Unsloth 2026.10.9 leaves it once imported: its defaults rewritten (two micro batches a step,
    weight decay 0.001); it keeps whatever else it is given."""

    def __init__(self, gradient_accumulation_steps: int = 2, weight_decay: float = 0.001, **settings) -> None:
        self.gradient_accumulation_steps, self.weight_decay = gradient_accumulation_steps, weight_decay
        self.__dict__.update(settings)


@pytest.mark.parametrize(
    ("objective", "module", "name"),
    [
        ("dpo", "trl", "DPOConfig"),
        ("kto", "trl", "KTOConfig"),
        ("simpo", "trl.experimental.cpo", "CPOConfig"),
    ],
)
def test_peer_trainers_get_the_runners_step_whatever_their_configs_defaults(
    tmp_path: Path, monkeypatch, objective: str, module: str, name: str
) -> None:
    """Unsloth rewrites TRL's config defaults; the peers' configs pass the step's settings, so a rewritten default
    changes nothing: one micro batch of the run's examples, no weight decay. (TRL's modules are stood in for by
    ones holding the rewritten configs: TRL is not a test dependency.)"""
    import types

    import dpo_peers

    for path in ("trl", "trl.experimental", "trl.experimental.cpo"):
        fake = types.ModuleType(path)
        for config in ("DPOConfig", "KTOConfig", "CPOConfig"):
            setattr(fake, config, type(config, (_RewrittenConfig,), {}))
        monkeypatch.setitem(sys.modules, path, fake)
    args = bench_dpo.parse_args([*TINY, "--row", "trl-peft", "--objective", objective, "--out", "x.json"])
    config = dpo_peers.trainer_config(args, tmp_path, checkpointing=False, liger=False)
    assert config.__class__ is getattr(sys.modules[module], name)
    assert (config.gradient_accumulation_steps, config.weight_decay) == (1, 0.0)
    assert (
        config.per_device_train_batch_size
        == dpo_peers.examples_per_step(args)
        == 2 * (1 + (objective == "kto"))
    )


def test_a_peer_step_other_than_the_runners_is_refused() -> None:
    """check_step: a trainer whose step is not the run's examples in one micro batch on one process fails the row
    instead of timing twice the work as one step."""
    from types import SimpleNamespace

    import dpo_peers

    args = bench_dpo.parse_args([*TINY, "--row", "unsloth", "--out", "x.json"])

    def trainer(batch: int, accumulation: int, processes: int = 1) -> SimpleNamespace:
        settings = SimpleNamespace(
            per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, world_size=processes
        )
        return SimpleNamespace(args=settings)

    dpo_peers.check_step(trainer(2, 1), args)
    for bad in (trainer(2, 2), trainer(4, 1), trainer(2, 1, 2)):
        with pytest.raises(RuntimeError, match=r"gradient_accumulation_steps=.* one micro batch"):
            dpo_peers.check_step(bad, args)


def test_run_gpu_dpo_graphs_part_runs_the_runner_eager_and_graphed_then_the_peers(tmp_path: Path) -> None:
    """run_gpu.sh's dpo-graphs: at the Qwen3-0.6B shape, the runner with CUDA graphs off, then on (pad_to_max_length,
    which auto asks for), then TRL + PEFT and Unsloth; python3 is stubbed."""
    from test_bench_train_step import run_gpu_calls

    calls = run_gpu_calls(tmp_path, "dpo-graphs")
    assert [c[1] for c in calls] == ["benchmarks/bench_dpo.py"] * 4
    assert all(c[c.index("--shape") + 1] == "qwen3-0.6b" for c in calls)
    settings = [c[c.index("--training") + 1] if "--training" in c else None for c in calls]
    assert settings == ["cuda_graphs=false", "pad_to_max_length=true", None, None]
    rows = [c[c.index("--row") + 1] if "--row" in c else None for c in calls]
    assert rows == [None, None, "trl-peft", "unsloth"]
    outs = [c[c.index("--out") + 1].rsplit("/", 1)[1] for c in calls]
    assert outs == [
        "dpo-qwen-loralei-eager.json",
        "dpo-qwen-loralei-graphed.json",
        "dpo-qwen-trl-peft.json",
        "dpo-qwen-unsloth.json",
    ]
