"""lora.use_dora through the runner on a tiny Llama: the magnitudes train, reach the optimizer (with A under
LoRA+), checkpoint and resume bit-exactly, and the combinations DoRA cannot take are refused by name."""

from __future__ import annotations

import pytest
import torch
from runner_helpers import collate, token_dataset

from loralei import LoRAConfig, inject_lora, lora_state_dict
from loralei.checkpoint import load_pretrained
from loralei.errors import ConfigError
from loralei.train.optim import build_optimizer
from loralei.train.run import train
from loralei.train.schema import validate_config
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("optimizers", "one_thread")


class Interrupt(Exception):
    """Simulates the process being killed."""


def _cfg(out, **training):
    return validate_config(
        {
            "model": {"name_or_path": "tiny-llama"},
            "data": {"path": "in-memory"},
            "lora": {"r": 4, "lora_alpha": 8, "use_dora": True},
            "training": {"max_steps": 3, "batch_size": 2, "save_steps": 2, "logging_steps": 1, **training},
            "optimizer": {"lr": 1e-2, "warmup_steps": 1, "loraplus_lr_ratio": 4.0},
            "output_dir": str(out),
        }
    )


def _run(cfg, callbacks=()):
    return train(
        cfg, model=tiny_model("llama"), dataset=token_dataset(), collate_fn=collate, callbacks=callbacks
    )


def _magnitudes(adapter_dir) -> dict[str, torch.Tensor]:
    tensors = lora_state_dict(load_pretrained(tiny_model("llama"), adapter_dir))
    return {k: v.detach().clone() for k, v in tensors.items() if k.endswith("lora_magnitude_vector")}


def test_magnitudes_train_checkpoint_and_resume_bit_exact(tmp_path):
    full = _run(_cfg(tmp_path / "full"))
    trained = _magnitudes(full.adapter_dir)
    initial = {
        k: v for k, v in lora_state_dict(inject_lora(tiny_model("llama"), LoRAConfig(use_dora=True))).items()
    }
    assert len(trained) == 14
    assert all(not torch.equal(trained[k], initial[k]) for k in trained)

    def kill_after_step_3(state):
        if state.global_step == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        _run(_cfg(tmp_path / "cut"), callbacks=[kill_after_step_3])
    resumed = _run(_cfg(tmp_path / "cut", resume_from_checkpoint=True))
    again = _magnitudes(resumed.adapter_dir)
    assert all(torch.equal(again[k], trained[k]) for k in trained)


def test_loraplus_puts_the_magnitudes_with_a():
    model = inject_lora(tiny_model("llama"), LoRAConfig(r=4, use_dora=True))
    opt = build_optimizer(model, "adamw", lr=1e-3, loraplus_lr_ratio=4.0)
    names = {id(p): n for n, p in model.named_parameters()}
    first, second = ([names[id(p)] for p in group["params"]] for group in opt.param_groups)
    assert sum(n.endswith("lora_magnitude_vector") for n in first) == 14
    assert all(".lora_B." in n for n in second) and len(second) == 14


@pytest.mark.parametrize(
    ("lora", "training", "message"),
    [
        (
            {"target_parameters": ["experts.down_proj"]},
            {},
            "use_dora=True cannot apply to target_parameters",
        ),
        (
            {},
            {"layer_offloading": True, "gradient_checkpointing": True},
            "training.layer_offloading: true does not run with lora.use_dora: true yet",
        ),
    ],
)
def test_combinations_it_cannot_take_are_refused(tmp_path, lora, training, message):
    raw = _cfg(tmp_path / "o").model_dump(mode="json", exclude_unset=True)
    raw["lora"] |= lora
    raw["training"] |= training
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate_config(raw)


def test_polora_updates_the_magnitudes_without_preconditioning():
    model = inject_lora(tiny_model("llama"), LoRAConfig(r=4, use_dora=True))
    opt = build_optimizer(model, "polora", lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    plain = [names[id(p)] for group in opt.param_groups if not group["paired"] for p in group["params"]]
    assert len(plain) == 14 and all(n.endswith("lora_magnitude_vector") for n in plain)
