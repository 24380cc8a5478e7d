"""Optimizers and learning-rate schedules for the fine-tuning runner.

``build_optimizer`` / ``build_scheduler`` turn the ``optimizer`` section of the YAML config into torch objects;
``SkipStepAdamW`` and ``PoLoRA`` are usable on their own.
"""

from .builder import OPTIMIZERS, build_optimizer
from .options import OptionError
from .polora import PoLoRA
from .schedules import SCHEDULES, build_scheduler
from .skipstep import SkipStepAdamW

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "OptionError",
    "PoLoRA",
    "SkipStepAdamW",
    "build_optimizer",
    "build_scheduler",
]
