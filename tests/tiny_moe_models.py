"""Tiny random-weight MoE causal LMs built from Transformers config classes (nothing downloaded).

Expert sizes are chosen so that no bank has ``in == out`` (hidden 32, expert intermediate 24): a factor stored
with in and out swapped cannot pass for the right one.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from tiny_models import _COMMON

HIDDEN, EXPERT_INTERMEDIATE, NUM_EXPERTS = 32, 24, 4

MOE_FAMILIES: dict[str, tuple[type, dict]] = {
    # gate_up_proj (E, 48, 32), down_proj (E, 32, 24)
    "qwen3_moe": (
        Qwen3MoeConfig,
        {"head_dim": 8, "moe_intermediate_size": EXPERT_INTERMEDIATE, "num_experts": NUM_EXPERTS},
    ),
    "mixtral": (
        MixtralConfig,
        {"intermediate_size": EXPERT_INTERMEDIATE, "num_local_experts": NUM_EXPERTS, "sliding_window": None},
    ),
}


def tiny_moe_model(family: str = "qwen3_moe", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer random-weight MoE causal LM (4 experts, top-2) of ``family`` in eval mode."""
    config_cls, extra = MOE_FAMILIES[family]
    common = {**_COMMON, "hidden_size": HIDDEN, "num_experts_per_tok": 2}
    config = config_cls(**{**common, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()
