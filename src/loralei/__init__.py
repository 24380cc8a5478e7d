"""loralei: fast, lean and exact LoRA fine-tuning for Hugging Face Transformers models."""

from .checkpoint import load_pretrained, lora_state_dict, save_pretrained
from .config import LoRAConfig
from .errors import CheckpointError, ConfigError, InjectionError, LoraleiError
from .fusion import FusionReport, apply_fused_kernels, remove_fused_kernels
from .inject import ParameterCount, count_parameters, inject_lora, lora_modules
from .merge import disable_lora, merge_and_unload_lora, merge_lora, unmerge_lora
from .modules.lora_linear import LoRALinear

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "FusionReport",
    "InjectionError",
    "LoRAConfig",
    "LoRALinear",
    "LoraleiError",
    "ParameterCount",
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
