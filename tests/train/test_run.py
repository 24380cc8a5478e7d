"""End-to-end runs of loralei.train.run.train on a tiny Llama with in-memory data (CPU, fp32)."""

from __future__ import annotations

import errno
import json
import math
import os
import signal

import pytest
import torch
from runner_helpers import collate, token_dataset

from loralei import lora_state_dict
from loralei.checkpoint import load_pretrained
from loralei.errors import CheckpointError, ConfigError
from loralei.train import build
from loralei.train.interrupt import RunInterrupted
from loralei.train.loop import TrainingError
from loralei.train.metrics import read_log
from loralei.train.output_dir import latest_checkpoint
from loralei.train.run import train
from loralei.train.schema import validate_config
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("optimizers", "one_thread")


class Interrupt(Exception):
    """Simulates the process being killed."""


def make_cfg(out, *, training=None, **top):
    raw = {
        "model": {"name_or_path": "tiny-llama"},
        "data": {"path": "in-memory"},
        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1},
        "training": {
            "max_steps": 6,
            "batch_size": 2,
            "gradient_accumulation_steps": 2,
            "logging_steps": 1,
            **(training or {}),
        },
        "optimizer": {"lr": 1e-2, "warmup_steps": 1},
        "output_dir": str(out),
        **top,
    }
    return validate_config(raw)


def run(cfg, callbacks=(), **model_overrides):
    model = tiny_model("llama", **model_overrides)
    return train(cfg, model=model, dataset=token_dataset(), collate_fn=collate, callbacks=callbacks)


def adapter_tensors(path):
    model = load_pretrained(tiny_model("llama"), path)
    return {k: v.detach().clone() for k, v in lora_state_dict(model).items()}


def losses(out):
    return [r["loss"] for r in read_log(out) if "loss" in r]


def test_resume_matches_uninterrupted_run_bit_for_bit(tmp_path):
    full = run(make_cfg(tmp_path / "full", training={"save_steps": 3}))

    def kill_after_step_4(state):
        if state.global_step == 4:
            raise Interrupt

    with pytest.raises(Interrupt):
        run(make_cfg(tmp_path / "cut", training={"save_steps": 3}), callbacks=[kill_after_step_4])
    assert not (tmp_path / "cut" / "adapter").exists()
    assert len(losses(tmp_path / "cut")) == 4  # step 4 was logged but never checkpointed: resume redoes it
    resumed = run(make_cfg(tmp_path / "cut", training={"save_steps": 3, "resume_from_checkpoint": True}))

    assert resumed.steps == full.steps == 6
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")  # exact float equality
    assert len(losses(tmp_path / "full")) == 6
    a, b = adapter_tensors(full.adapter_dir), adapter_tensors(resumed.adapter_dir)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_and_the_resumed_run_is_bit_exact(tmp_path, signum):
    full = run(make_cfg(tmp_path / "full", training={"save_steps": 3}))

    def signal_after_step_4(state):
        if state.global_step == 4:  # the loop sees the request before step 5, and saves step 4
            os.kill(os.getpid(), signum)

    with pytest.raises(RunInterrupted) as info:
        run(make_cfg(tmp_path / "cut", training={"save_steps": 3}), callbacks=[signal_after_step_4])
    stopped = info.value
    assert (stopped.signum, stopped.started, stopped.step, stopped.exit_status) == (
        signum,
        True,
        4,
        128 + signum,
    )
    assert stopped.checkpoint == tmp_path / "cut" / "checkpoints" / "checkpoint-000004"
    assert latest_checkpoint(tmp_path / "cut") == stopped.checkpoint
    assert signal.getsignal(signum) is not None and not (tmp_path / "cut" / "adapter").exists()
    resumed = run(make_cfg(tmp_path / "cut", training={"save_steps": 3}))  # auto: the same config resumes
    assert resumed.steps == full.steps == 6
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")  # exact float equality
    a, b = adapter_tensors(full.adapter_dir), adapter_tensors(resumed.adapter_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_signal_before_the_first_step_keeps_nothing(tmp_path, monkeypatch):
    from loralei.train.interrupt import StopSignals

    graceful = StopSignals.graceful

    def signalled_at_once(self):
        graceful(self)
        os.kill(os.getpid(), signal.SIGINT)  # asks for a stop: the loop sees it before step 1

    monkeypatch.setattr(StopSignals, "graceful", signalled_at_once)
    with pytest.raises(RunInterrupted) as info:
        run(make_cfg(tmp_path / "o", training={"save_steps": 1}))
    assert (info.value.started, info.value.checkpoint) == (False, None)
    assert list((tmp_path / "o").iterdir()) == []  # no checkpoint of step 0, no log: as it was


@pytest.mark.parametrize("name", ["skipstepadamw", "polora"])
def test_every_optimizer_checkpoints_and_resumes_bit_exact(tmp_path, name):
    """SkipStepAdamW keeps a skip detector that belongs to no parameter: it is saved beside the parameters' state
    (torch.distributed.checkpoint keeps only state by parameter name) and restored with it."""
    optimizer = {"optimizer": {"name": name, "lr": 1e-2, "warmup_steps": 1}}
    full = run(make_cfg(tmp_path / "full", training={"save_steps": 2}, **optimizer))

    def stop_after_step_3(state):
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(RunInterrupted):
        run(
            make_cfg(tmp_path / "cut", training={"save_steps": 2}, **optimizer), callbacks=[stop_after_step_3]
        )
    extra = tmp_path / "cut" / "checkpoints" / "checkpoint-000003" / "optimizer_extra.pt"
    assert extra.is_file() == (name == "skipstepadamw")
    resumed = run(make_cfg(tmp_path / "cut", training={"save_steps": 2}, **optimizer))
    assert resumed.steps == full.steps == 6
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    a, b = adapter_tensors(full.adapter_dir), adapter_tensors(resumed.adapter_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_pissa_run_resumes_bit_exact_from_its_saved_initial_factors(tmp_path, monkeypatch):
    """The resumed run rebuilds the residual base from the checkpoint's initial factors (a randomized SVD run
    again would not give the same residual, and decomposing the residual itself would be wrong)."""
    lora = {"lora": {"r": 4, "lora_alpha": 8, "init_lora_weights": "pissa_niter_2"}}
    full = run(make_cfg(tmp_path / "full", training={"save_steps": 2}, **lora))

    def kill_after_step_3(state):
        if state.global_step == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        run(make_cfg(tmp_path / "cut", training={"save_steps": 2}, **lora), callbacks=[kill_after_step_3])

    def no_second_decomposition(*args, **kwargs):
        raise AssertionError("the resumed run decomposed the base again")

    monkeypatch.setattr("loralei.modules.principal_init.principal_factors", no_second_decomposition)
    torch.manual_seed(123)  # a randomized SVD here would draw other vectors than the first run's
    resumed = run(
        make_cfg(tmp_path / "cut", training={"save_steps": 2, "resume_from_checkpoint": True}, **lora)
    )
    assert resumed.steps == full.steps == 6
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    a, b = adapter_tensors(full.adapter_dir), adapter_tensors(resumed.adapter_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_is_said_plainly_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from loralei.train import run as run_module

    write = run_module.write_checkpoint
    calls = []

    def fills_the_disk_on_the_second_save(out, *args, **kwargs):
        calls.append(out)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(out / "checkpoints"))
        return write(out, *args, **kwargs)

    monkeypatch.setattr(run_module, "write_checkpoint", fills_the_disk_on_the_second_save)
    with pytest.raises(
        TrainingError, match=r"/checkpoints: No space left on device; its last checkpoint is kept"
    ):
        run(make_cfg(tmp_path / "o", training={"save_steps": 2}))
    assert latest_checkpoint(tmp_path / "o").name == "checkpoint-000002"
    calls[:] = [None]  # the next save fails: the run's first
    with pytest.raises(TrainingError, match="No space left on device; the output directory is as it was"):
        run(make_cfg(tmp_path / "p", training={"save_steps": 2}))
    assert list((tmp_path / "p").iterdir()) == []


def test_loss_falls_and_outputs_are_written(tmp_path):
    cfg = make_cfg(
        tmp_path / "out",
        training={"max_steps": 30, "gradient_accumulation_steps": 1, "logging_steps": 5, "save_merged": True},
    )
    # The default init (std 0.02) gives a frozen head too small for logits to move much; 0.3 lets them.
    result = run(cfg, initializer_range=0.3)
    records = read_log(tmp_path / "out")
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25, 30]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps", "epoch"):
        assert key in records[0]
    assert result.last_loss < 0.7 * result.first_loss
    for name in (
        "adapter/loralei_adapter.safetensors",
        "adapter_peft/adapter_config.json",
        "adapter_peft/adapter_model.safetensors",
        "merged/config.json",
        "run_summary.json",
    ):
        assert (tmp_path / "out" / name).is_file(), name
    text = result.summary()
    assert "30 steps" in text and "->" in text and str(result.adapter_dir) in text
    assert "LoRA: r=4 on 14 linear modules; " in text and "plot: " in text
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["steps"] == 30 and summary["setup_notes"] == result.setup_notes
    assert "training.liger_kernel: auto -> off: no CUDA device" in result.setup_notes
    assert summary["memory_gib"]["setup_host"] > 0  # the setup's resident host memory, on any device


def test_only_lora_factors_change(tmp_path):
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(make_cfg(tmp_path / "o"), model=model, dataset=token_dataset(), collate_fn=collate)
    after = {k: v.cpu() for k, v in model.state_dict().items()}  # the run may have moved it to a GPU
    assert all(torch.equal(before[k], after[k]) for k in before)  # every base weight, the head included
    lora_b = [v for k, v in after.items() if k.endswith("lora_B.weight")]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)  # B starts at zero: it trained
    assert not model.get_output_embeddings().weight.requires_grad


# a one-step run has no room for a warm-up (warmup_steps must be below max_steps)
ONE_STEP = {"training": {"max_steps": 1}, "optimizer": {"lr": 1e-2}}


def test_existing_run_is_not_overwritten_silently(tmp_path):
    run(make_cfg(tmp_path / "o", **ONE_STEP))
    with pytest.raises(
        ConfigError, match=r"output_dir: .* already holds a finished run.*overwrite_output_dir"
    ):
        run(make_cfg(tmp_path / "o", **ONE_STEP))
    result = run(make_cfg(tmp_path / "o", training={"max_steps": 2}, overwrite_output_dir=True))
    assert result.steps == 2 and [r["step"] for r in read_log(tmp_path / "o")] == [1, 2]


def test_resuming_into_another_dir_does_not_overwrite_its_finished_run(tmp_path):
    run(make_cfg(tmp_path / "a", training={"save_steps": 2, "max_steps": 3}))
    run(make_cfg(tmp_path / "b", **ONE_STEP))
    resume = {"resume_from_checkpoint": str(latest_checkpoint(tmp_path / "a")), "max_steps": 3}
    with pytest.raises(ConfigError, match=r"output_dir: .* already holds a finished run"):
        run(make_cfg(tmp_path / "b", training=resume))
    assert [r["step"] for r in read_log(tmp_path / "b")] == [1]  # untouched
    result = run(make_cfg(tmp_path / "c", training=resume))  # a free directory is fine
    assert result.steps == 3


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        run(make_cfg(tmp_path / "o", training={"resume_from_checkpoint": True}))
    with pytest.raises(CheckpointError, match="not a complete loralei checkpoint"):
        run(make_cfg(tmp_path / "o", training={"resume_from_checkpoint": str(tmp_path)}))


def test_resume_with_other_lora_shape_is_an_error(tmp_path):
    run(make_cfg(tmp_path / "o", training={"save_steps": 2, "max_steps": 3}))
    cfg = make_cfg(tmp_path / "o", training={"resume_from_checkpoint": True}, lora={"r": 8})
    with pytest.raises(CheckpointError, match=r"lora.r=4.*this run has lora.r=8"):
        run(cfg)
    cfg = make_cfg(tmp_path / "o", training={"resume_from_checkpoint": True})
    with pytest.raises(CheckpointError, match=r"hidden_size=32.*hidden_size=64"):
        train(cfg, model=tiny_model("llama", hidden_size=64), dataset=token_dataset(), collate_fn=collate)


def test_non_finite_loss_stops_without_saving(tmp_path, monkeypatch):
    from loralei.train import setup

    def nan_loss(name, *, liger, cce_impl):
        def loss_fn(model, batch, labels, num_items):
            out = model(input_ids=batch["input_ids"]).logits.sum()
            return out * math.nan

        return loss_fn

    monkeypatch.setattr(setup, "build_loss", nan_loss)
    model = tiny_model("llama")
    cfg = make_cfg(tmp_path / "o", training={"max_consecutive_skipped_steps": 3, "save_steps": 1})
    with pytest.raises(TrainingError, match="non-finite for 3 consecutive steps"):
        train(cfg, model=model, dataset=token_dataset(), collate_fn=collate)
    assert all(torch.isfinite(v).all() for v in lora_state_dict(model).values())
    assert not (tmp_path / "o" / "adapter").exists()
    saved = latest_checkpoint(tmp_path / "o")
    assert saved is not None and saved.name == "checkpoint-000002"  # steps 1-2 were skipped, state is clean


def test_gradient_checkpointing_gives_the_same_losses(tmp_path):
    plain = make_cfg(tmp_path / "a", lora={"r": 4, "lora_alpha": 8})
    ckpt = make_cfg(tmp_path / "b", lora={"r": 4, "lora_alpha": 8}, training={"gradient_checkpointing": True})
    run(plain), run(ckpt)
    assert losses(tmp_path / "a") == pytest.approx(losses(tmp_path / "b"), rel=1e-5)


def test_missing_optional_packages_are_reported_before_loading(tmp_path, monkeypatch):
    for module in ("liger_kernel", "cut_cross_entropy", "wandb"):
        monkeypatch.setitem(__import__("sys").modules, module, None)
    cases = [
        ({"training": {"liger_kernel": True}}, "training.liger_kernel needs the 'liger_kernel' package"),
        ({"training": {"loss": "cce"}}, "cut_cross_entropy needs the 'cut_cross_entropy' package"),
        ({"wandb": {"project": "x"}}, "wandb: .*'wandb' package is not installed"),
        ({"training": {"report_to": "wandb"}}, "wandb: .*'wandb' package is not installed"),
    ]
    for top, message in cases:
        training = top.pop("training", {})
        with pytest.raises(ConfigError, match=message):
            build.check_optional_dependencies(make_cfg(tmp_path, training=training, **top))


def test_evaluation_is_logged_and_leaves_training_untouched(tmp_path):
    base = make_cfg(tmp_path / "plain")
    with_eval = make_cfg(
        tmp_path / "eval",
        training={"eval_steps": 3, "eval_batch_size": 5},
        data={"path": "in-memory", "eval_split": "held-out"},
    )
    run(base)
    train(
        with_eval,
        model=tiny_model("llama"),
        dataset=token_dataset(),
        collate_fn=collate,
        eval_dataset=token_dataset(n=7, seed=9),
    )
    records = read_log(tmp_path / "eval")
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all(math.isfinite(r["eval_loss"]) for r in evals)
    assert losses(tmp_path / "eval") == losses(tmp_path / "plain")  # eval uses no training RNG or state


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_runs_train_with_finite_losses(tmp_path, dtype):
    lora = {"r": 4, "lora_alpha": 8, "lora_fp32_gradients": True}
    cfg = make_cfg(tmp_path / dtype, lora=lora, model={"name_or_path": "tiny", "dtype": dtype})
    torch_dtype = getattr(torch, dtype)
    model = tiny_model("llama", dtype=torch_dtype)
    result = train(cfg, model=model, dataset=token_dataset(), collate_fn=collate)
    assert result.skipped_steps == 0 and all(math.isfinite(v) for v in losses(tmp_path / dtype))
    assert model.get_output_embeddings().weight.dtype == torch_dtype
    assert all(v.dtype == torch.float32 for v in lora_state_dict(model).values())


@pytest.mark.parametrize("frozen_before", [False, True])
def test_the_loop_runs_with_the_setup_objects_hidden_from_the_garbage_collector(tmp_path, frozen_before):
    """Full collections inside the loop walk only what the loop made (the model and libraries are frozen out
    of them), and the freeze ends with the run, unless the caller had frozen objects of its own."""
    import gc

    gc.unfreeze()
    if frozen_before:
        gc.freeze()
    seen = []
    try:
        run(
            make_cfg(tmp_path, training={"max_steps": 2}),
            callbacks=[lambda s: seen.append(gc.get_freeze_count())],
        )
        assert len(seen) == 2 and min(seen) > 10_000  # torch's and the model's objects, at least
        assert (gc.get_freeze_count() > 0) == frozen_before
    finally:
        gc.unfreeze()


def test_host_batches_are_pinned_on_cuda_by_default(tmp_path):
    """pin_memory: auto pins on CUDA (a copy from pinned memory is queued on the stream; from pageable memory
    the host waits for it); explicit values are kept; on the CPU nothing is pinned."""
    from loralei.train.setup import pin_memory

    assert make_cfg(tmp_path).training.pin_memory == "auto"
    assert pin_memory("auto", torch.device("cuda")) is True
    assert pin_memory("auto", torch.device("cpu")) is False
    assert pin_memory(False, torch.device("cuda")) is False and pin_memory(True, torch.device("cpu")) is True


def test_a_qat_run_trains_the_factors_on_the_plain_path_and_says_why(tmp_path):
    model = tiny_model("llama", initializer_range=0.3)
    lora = {"r": 4, "lora_alpha": 8, "qat": {"weight": "nvfp4"}}
    cfg = make_cfg(tmp_path / "o", lora=lora, training={"max_steps": 8, "gradient_accumulation_steps": 1})
    result = train(cfg, model=model, dataset=token_dataset(), collate_fn=collate)
    assert result.last_loss < result.first_loss
    notes = "\n".join(result.setup_notes)
    assert "0 LoRA projections fused" in notes and "plain: lora.qat: the forward fake-quantizes" in notes
    saved = load_pretrained(tiny_model("llama"), result.adapter_dir)
    assert next(m for m in saved.modules() if hasattr(m, "lora_A")).config.qat.weight == "nvfp4"


def test_qat_fake_quantizes_from_its_start_step_on_and_a_resumed_run_continues_there(tmp_path, monkeypatch):
    """With ``qat.start_step: 2`` the first two steps train plain LoRA and the rest the fake-quantized weight; a run
    resumed from its step-3 checkpoint fake-quantizes from its first step on."""
    from loralei.modules import lora_linear

    calls: list[int] = []
    qat_linear = lora_linear.qat_linear
    monkeypatch.setattr(lora_linear, "qat_linear", lambda *a: calls.append(1) or qat_linear(*a))
    lora = {"r": 4, "lora_alpha": 8, "qat": {"weight": "nvfp4", "start_step": 2}}
    training = {"max_steps": 5, "gradient_accumulation_steps": 1, "save_steps": 3}
    per_step: list[int] = []
    stop_after = [4]

    def count(state) -> None:
        per_step.append(len(calls))
        calls.clear()
        if state.global_step in stop_after:
            raise Interrupt

    with pytest.raises(Interrupt):
        run(make_cfg(tmp_path / "o", lora=lora, training=training), callbacks=[count])
    projections = 7 * 2  # tiny Llama: 7 projections, 2 layers; one forward each per step
    assert per_step == [0, 0, projections, projections]
    per_step.clear()
    stop_after.clear()
    run(make_cfg(tmp_path / "o", lora=lora, training=training | {"resume_from_checkpoint": True}), [count])
    assert per_step == [projections, projections]  # steps 4 and 5, after the step-3 checkpoint
