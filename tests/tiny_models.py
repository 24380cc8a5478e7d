"""Tiny random-weight models of real families, built from Transformers config classes (nothing downloaded)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    FineGrainedFP8Config,
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
from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear

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


@torch.no_grad()
def perturb_magnitudes(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Moves every DoRA magnitude off its initial row norms, as training would (else DoRA's rescale is 1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_magnitude_vector" in name:
            p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def tiny_moe_model(family: str = "qwen3_moe", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer random-weight MoE causal LM (``MOE_FAMILIES``) in eval mode."""
    return tiny_model(family, dtype, seed, **overrides)


# Fine-grained FP8 checkpoints (Transformers' FP8Linear, a scale per 128x128 block) at a few blocks per weight:
# hidden 256 (2 blocks), 4 heads of 64 (k/v 128 rows: 1 block), and an MLP of 320 (2.5 blocks: gate/up's last row
# block and down's last column block are partial, as in DeepSeek-V3's 576-row kv_a_proj_with_mqa).
FP8_DIMS = {"hidden_size": 256, "intermediate_size": 320, "head_dim": 64}
FP8_BLOCK = 128


def fp8_checkpoint_weight(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense`` (out, in) as a fine-grained FP8 checkpoint holds it: e4m3 codes (out, in) and float32 scales
    (⌈out/128⌉, ⌈in/128⌉), by Transformers' own quantizer (``Fp8Quantize``) run on the weight zero-padded to whole
    blocks (the zeros change no block's amax)."""
    rows, cols = dense.shape
    padded = F.pad(dense, (0, -cols % FP8_BLOCK, 0, -rows % FP8_BLOCK))
    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    out = quantizer.convert({"w.weight": padded})
    return out["w.weight"][:rows, :cols].contiguous(), out["w.weight_scale_inv"]


def tiny_fp8_model(family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """``tiny_model`` at ``FP8_DIMS`` as loaded from a fine-grained FP8 checkpoint: every linear but the head is
    Transformers' ``FP8Linear`` (``replace_with_fp8_linear``) holding the dense weight's codes and block scales
    (:func:`fp8_checkpoint_weight`) and the dense bias; the rest keeps ``dtype``."""
    model = tiny_model(family, dtype, seed, **{**FP8_DIMS, **overrides})
    dense = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    replace_with_fp8_linear(
        model, modules_to_not_convert=["lm_head"], quantization_config=FineGrainedFP8Config()
    )
    for name, module in model.named_modules():
        if name in dense and module is not dense[name]:
            codes, scales = fp8_checkpoint_weight(dense[name].weight.detach())
            module.weight = torch.nn.Parameter(codes, requires_grad=False)
            module.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
            module.bias = dense[name].bias
    return model
