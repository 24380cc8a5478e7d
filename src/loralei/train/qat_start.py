"""``lora.qat.start_step``: the first optimizer steps train plain LoRA on the dense merged weight, then every
forward fake-quantizes it.

Straight-through training sees the loss of the quantized weight from its first step, where an update smaller than
half a quantization step changes nothing the loss sees; on coarse formats and small models that slows it down
(README, the QAT tables). Starting from a dense LoRA run lets the adapter first learn the task, then adapt to the
format. The switch is each QAT projection's ``qat_active`` flag, set from the loop state: after every optimizer
step (a step callback) and once before the first (a resumed run continues in the phase it stopped in).
"""

from __future__ import annotations

from torch import nn

from ..inject import lora_modules
from .state import TrainState


class QATStart:
    """Switches fake quantization on for the QAT projections of ``model`` once ``start_step`` steps have run."""

    def __init__(self, model: nn.Module, start_step: int) -> None:
        self.start_step = start_step
        self.modules = [m for _, m in lora_modules(model) if m.config.qat is not None]

    def __call__(self, state: TrainState) -> None:
        active = state.global_step >= self.start_step
        for module in self.modules:
            module.qat_active = active
