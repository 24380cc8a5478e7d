"""Saving and loading adapters that started from PiSSA/OLoRA initial factors (:mod:`.modules.principal_init`).

PEFT format: the trained model is ``W_res + s·B·A`` and ``W = W_res + s·B0·A0``, so relative to the original
``W`` the update is ``s·(B·A − B0·A0) = s·[B, −B0]·[A; A0]``: a plain LoRA of rank 2r (as PEFT's
``path_initial_model_for_weight_conversion`` writes it). Its config says rank ``2r`` and ``init_lora_weights:
true``, and keeps the scale: ``lora_alpha`` doubles (times √2 with rsLoRA, whose scale is ``alpha / √r``). PEFT,
vLLM and loralei load it on the unmodified base.

Native format: the initial factors are saved beside the trained ones (``<module>.lora_A_init`` r×in,
``<module>.lora_B_init`` out×r), and a load injects into the original base without decomposing it, then rebuilds
the same residual from the saved factors (:func:`restore_initial`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import LoRAConfig
from .errors import CheckpointError
from .inject import inject_lora, injection_record, lora_modules
from .modules.principal_init import (
    INIT_A,
    INIT_B,
    initial_factors,
    initial_factors_to_come,
    is_principal,
    start_from,
)
from .peft_format import PEFT_PREFIX


def initial_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The initial factors of ``model``'s PiSSA/OLoRA modules under their native names (empty for other inits)."""
    out = {}
    for name, module in lora_modules(model):
        factors = initial_factors(module)
        if factors is not None:
            out[f"{name}.{INIT_A}"], out[f"{name}.{INIT_B}"] = factors
    return out


def initial_adapter(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The initial factors under the trained factors' names (``<module>.lora_A.weight``): the adapter the
    PiSSA/OLoRA model started from, whose outputs are the original model's; ``None`` for other inits."""
    out = {}
    for name, module in lora_modules(model):
        factors = initial_factors(module)
        if factors is not None:
            out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = factors
    return out or None


def as_plain_lora(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT-format ``tensors`` with each PiSSA/OLoRA module's factors widened to the rank-2r plain LoRA
    ``[A; A0]`` / ``[B, −B0]`` relative to the original base (other tensors unchanged)."""
    out = dict(tensors)
    for name, module in lora_modules(model):
        factors = initial_factors(module)
        if factors is None:
            continue
        a0, b0 = (t.detach().to("cpu") for t in factors)
        key_a, key_b = f"{PEFT_PREFIX}{name}.lora_A.weight", f"{PEFT_PREFIX}{name}.lora_B.weight"
        out[key_a] = torch.cat([out[key_a], a0.to(out[key_a].dtype)], dim=0).contiguous()
        out[key_b] = torch.cat([out[key_b], -b0.to(out[key_b].dtype)], dim=1).contiguous()
    return out


def plain_lora_config(model: nn.Module, data: dict[str, Any]) -> dict[str, Any]:
    """``adapter_config.json`` ``data`` for :func:`as_plain_lora`'s tensors: rank doubled, same scale."""
    config = injection_record(model).config
    if not is_principal(config.init_lora_weights):
        return data
    alpha = config.lora_alpha * (math.sqrt(2.0) if config.use_rslora else 2.0)
    return data | {
        "r": 2 * config.r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "init_lora_weights": True,
    }


# PEFT inits that rewrite the base weight: an adapter saved with one of them (not converted) is relative to that
# rewritten base, which loading on the original model would not have.
_PEFT_BASE_REWRITING = re.compile(r"(pissa(_niter_\d+)?|olora|corda|loftq)", re.IGNORECASE)


def refuse_residual_peft_adapter(meta: dict[str, Any], file: Path) -> None:
    """Refuses a PEFT adapter saved relative to a base its init rewrote (PiSSA, OLoRA, CorDA, LoftQ).

    Raises:
        CheckpointError: ``init_lora_weights`` in ``meta`` is such an init.
    """
    init = meta.get("init_lora_weights")
    if isinstance(init, str) and _PEFT_BASE_REWRITING.fullmatch(init):
        raise CheckpointError(
            f"{file}: init_lora_weights={init!r}: PEFT saved this adapter relative to the base its init rewrote "
            "(the residual), so on the original model it would give other outputs; save it with PEFT's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...) to get a plain LoRA, or train it "
            "with loralei, whose PEFT export is converted"
        )


def pop_initial(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Removes and returns the initial-factor tensors of a native adapter's ``tensors``."""
    keys = [k for k in tensors if k.endswith((f".{INIT_A}", f".{INIT_B}"))]
    return {k: tensors.pop(k) for k in keys}


@torch.no_grad()
def restore_initial(model: nn.Module, initial: dict[str, torch.Tensor], path: Path) -> None:
    """Starts every PiSSA/OLoRA module of ``model`` from its saved initial factors (residual rebuilt from the
    original base), or checks that a module already started from the same ones.

    Raises:
        CheckpointError: a factor is missing, unexpected or misshapen, or a module already started from other
            initial factors (its base is another residual).
    """
    wanted = set()
    for name, module in lora_modules(model):
        if not is_principal(module.config.init_lora_weights):
            continue
        key_a, key_b = f"{name}.{INIT_A}", f"{name}.{INIT_B}"
        wanted |= {key_a, key_b}
        if key_a not in initial or key_b not in initial:
            raise CheckpointError(
                f"adapter {path} was trained with init_lora_weights={module.config.init_lora_weights!r} but holds "
                f"no initial factors for '{name}' ({key_a}); the adapter is incomplete, save it again"
            )
        a0, b0 = initial[key_a], initial[key_b]
        if a0.shape != module.lora_A.weight.shape or b0.shape != module.lora_B.weight.shape:
            raise CheckpointError(
                f"adapter {path}: the initial factors of '{name}' have shapes {tuple(a0.shape)}, {tuple(b0.shape)} "
                "but the module's factors do not; the adapter was trained on a differently sized model or rank"
            )
        have = initial_factors(module)
        if have is None:
            start_from(module, a0, b0)
        elif not (
            torch.equal(have[0].cpu(), a0.to(have[0].dtype))
            and torch.equal(have[1].cpu(), b0.to(have[1].dtype))
        ):
            raise CheckpointError(
                f"adapter {path} started '{name}' from other PiSSA/OLoRA factors than this model's adapter, whose "
                "base is another residual; load it into the original model without LoRA"
            )
    unexpected = sorted(initial.keys() - wanted)
    if unexpected:
        raise CheckpointError(
            f"adapter {path} holds PiSSA/OLoRA initial factors ({unexpected[:3]}) but the model's adapter does not "
            "start from them; load it into the original model without LoRA"
        )


def inject_from_initial(
    model: nn.Module, config: LoRAConfig, initial: dict[str, torch.Tensor], path: Path
) -> None:
    """``inject_lora(model, config)`` with every PiSSA/OLoRA module started from the saved ``initial`` factors
    (of the adapter at ``path``) instead of a new decomposition, so the residual base is the one they left.

    Raises:
        CheckpointError: as :func:`restore_initial`.
    """
    with initial_factors_to_come():
        inject_lora(model, config)
    restore_initial(model, initial, path)
