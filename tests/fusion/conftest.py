"""Until ops.lora_mlp (written in parallel) is merged, the MLP wiring is tested through a plain twin with the
same signature, installed only when the real module does not exist."""

from __future__ import annotations

import importlib.util
import sys
import types

import torch
import torch.nn.functional as F

from loralei.ops import reference
from loralei.ops.weights import LoRAWeights

_ACT = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def _lora_mlp_twin(
    x: torch.Tensor,
    gate: LoRAWeights,
    up: LoRAWeights,
    down: LoRAWeights,
    activation: str,
    masks: tuple[torch.Tensor | None, ...] | None = None,
) -> torch.Tensor:
    mg, mu, md = masks or (None, None, None)
    h = _ACT[activation](reference.lora_linear(x, gate, mg)) * reference.lora_linear(x, up, mu)
    return reference.lora_linear(h, down, md)


if importlib.util.find_spec("loralei.ops.lora_mlp") is None:
    _shim = types.ModuleType("loralei.ops.lora_mlp")
    _shim.lora_mlp = getattr(reference, "lora_mlp", _lora_mlp_twin)
    sys.modules["loralei.ops.lora_mlp"] = _shim
