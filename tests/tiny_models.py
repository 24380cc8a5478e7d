"""Tiny random-weight models of real families, built from Transformers config classes (nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

_COMMON = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Per-family differences are data: the config class and the keys it needs beyond the common ones.
# Gemma 2 has no SDPA path in Transformers (soft-capping), so it runs eager attention.
EAGER_ONLY = {"gemma2"}
FAMILIES: dict[str, tuple[type, dict]] = {
    "llama": (LlamaConfig, {}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 8}),
    "gemma2": (Gemma2Config, {"head_dim": 8, "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": (Gemma3TextConfig, {"head_dim": 8, "hidden_activation": "gelu_pytorch_tanh"}),
    "phi3": (Phi3Config, {}),
}


# MoE families (experts kept as 3-D banks in one experts module), top-2 of MOE_EXPERTS. No bank has in == out
# (hidden 32, expert intermediate 24): a factor stored with in and out swapped cannot pass for the right one.
MOE_EXPERTS, MOE_INTERMEDIATE = 6, 24
_MOE = {"num_experts_per_tok": 2}
MOE_FAMILIES: dict[str, tuple[type, dict]] = {
    "qwen3_moe": (
        Qwen3MoeConfig,
        {**_MOE, "head_dim": 8, "num_experts": MOE_EXPERTS, "moe_intermediate_size": MOE_INTERMEDIATE},
    ),
    "mixtral": (
        MixtralConfig,
        {**_MOE, "num_local_experts": MOE_EXPERTS, "intermediate_size": MOE_INTERMEDIATE},
    ),
    "qwen2_moe": (  # with a shared expert: a plain gated MLP beside the experts
        Qwen2MoeConfig,
        {
            **_MOE,
            "num_experts": MOE_EXPERTS,
            "moe_intermediate_size": MOE_INTERMEDIATE,
            "shared_expert_intermediate_size": 40,
        },
    ),
    "olmoe": (OlmoeConfig, {**_MOE, "num_experts": MOE_EXPERTS, "intermediate_size": MOE_INTERMEDIATE}),
}
FAMILIES.update(MOE_FAMILIES)


def tiny_model(family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer random-weight causal LM of ``family`` in eval mode (SDPA attention where the family has it)."""
    config_cls, extra = FAMILIES[family]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    attn = "eager" if family in EAGER_ONLY else "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval()


def tiny_batch(batch: int = 2, seq: int = 12, vocab: int = 128, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random token ids with labels equal to the ids (causal LM loss)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def tiny_moe_model(family: str = "qwen3_moe", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer random-weight MoE causal LM (``MOE_FAMILIES``) in eval mode."""
    return tiny_model(family, dtype, seed, **overrides)
