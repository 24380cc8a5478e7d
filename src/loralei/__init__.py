"""loralei: fast, lean and exact LoRA fine-tuning for Hugging Face Transformers models.

``LoRAConfig`` and the errors load at once; everything that needs torch or Transformers is imported on first
use (PEP 562), so that ``import loralei`` and the command line's ``--help`` and config errors answer without
loading them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from .config import LoRAConfig, QATConfig
from .errors import CheckpointError, ConfigError, InjectionError, LoraleiError

if TYPE_CHECKING:
    from .checkpoint import load_pretrained, lora_state_dict, save_pretrained
    from .fusion import FusionReport, apply_fused_kernels, remove_fused_kernels
    from .inject import ParameterCount, count_parameters, inject_lora, lora_modules
    from .merge import disable_lora, merge_and_unload_lora, merge_lora, unmerge_lora
    from .modules.lora_linear import LoRALinear

__version__ = "0.1.0"

# The public names that need torch, by the module that defines them.
_LAZY = {
    "load_pretrained": ".checkpoint",
    "lora_state_dict": ".checkpoint",
    "save_pretrained": ".checkpoint",
    "FusionReport": ".fusion",
    "apply_fused_kernels": ".fusion",
    "remove_fused_kernels": ".fusion",
    "ParameterCount": ".inject",
    "count_parameters": ".inject",
    "inject_lora": ".inject",
    "lora_modules": ".inject",
    "disable_lora": ".merge",
    "merge_and_unload_lora": ".merge",
    "merge_lora": ".merge",
    "unmerge_lora": ".merge",
    "LoRALinear": ".modules.lora_linear",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "FusionReport",
    "InjectionError",
    "LoRAConfig",
    "LoRALinear",
    "LoraleiError",
    "ParameterCount",
    "QATConfig",
    "apply_fused_kernels",
    "count_parameters",
    "disable_lora",
    "inject_lora",
    "load_pretrained",
    "lora_modules",
    "lora_state_dict",
    "merge_and_unload_lora",
    "merge_lora",
    "remove_fused_kernels",
    "save_pretrained",
    "unmerge_lora",
]


def __getattr__(name: str) -> Any:
    """Imports the module behind a public name on first use and keeps the name here; ``loralei.<submodule>``
    imports that submodule, as it did when this package imported them all."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
