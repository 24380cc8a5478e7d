"""The train-step benchmark's shapes and rows: what model each row trains and how it is built.

A shape is a random-weight model of a real architecture's dimensions (config class, config, batch, seq). A row is
one way to put LoRA on it: PEFT (``peft-*``; ``peft-gptq`` on a GPTQ copy of the checkpoint, in a child process
that imported gptqmodel first), Unsloth (``unsloth-*``, in a child process that imported Unsloth first), loralei
(``loralei-*``, unfused, fused or with a quantized base), Axolotl's LoRA kernels on a PEFT model (``axolotl-*``,
in a child process), optionally with Liger's kernels.
``prepared_model`` builds a row's model; ``bench_train_step.py`` times its steps.

Dense shapes adapt q,k,v,o,gate,up,down. MoE shapes (``is_moe``) keep their experts as packed 3-D banks, so they
adapt q,k,v,o as modules and the banks as parameters (PEFT's and loralei's ``target_parameters``); Unsloth gets
the same seven names and maps gate/up/down onto the banks itself.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # the package under test
from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.train.losses import linear_cross_entropy_loss

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION_TARGETS = TARGETS[:4]
# MoE shapes: the experts' banks, as loralei's parameter-name suffixes and as PEFT's (relative to a layer).
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]
PEFT_EXPERT_PARAMETERS = [f"mlp.{name}" for name in EXPERT_PARAMETERS]
# loralei's targets on MoE shapes (LoRAConfig fields, as the runner's lora section takes them)
MOE_TARGETS = {"target_modules": ATTENTION_TARGETS, "target_parameters": EXPERT_PARAMETERS}
RANK, ALPHA = 16, 32

LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
}
# Long-context rows (issue 45's memory slope): one sequence of 32K-256K tokens; one config for all lengths, so
# they share one saved checkpoint
LLAMA3_8B_LONG = {**LLAMA3_8B, "max_position_embeddings": 262144}
LONG_LENGTHS = {"32k": 32768, "64k": 65536, "128k": 131072, "256k": 262144}

# Issue 46's model larger than the GPU: Llama-3-70B's shape, 8,192 tokens a step
LLAMA3_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}

SHAPES: dict[str, tuple[type, dict, int, int]] = {  # config class, config, batch, seq
    "llama3-8b": (LlamaConfig, LLAMA3_8B, 4, 2048),
    "llama3-70b": (LlamaConfig, LLAMA3_70B, 4, 2048),
    **{f"llama3-8b-{name}": (LlamaConfig, LLAMA3_8B_LONG, 1, n) for name, n in LONG_LENGTHS.items()},
    "qwen3-0.6b": (
        Qwen3Config,
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
        8,
        2048,
    ),
    # Qwen3-30B-A3B's layer, 8 of its 48 layers: every layer sparse (128 experts, 8 per token).
    "qwen3-30b-a3b-8l": (
        Qwen3MoeConfig,
        {
            "hidden_size": 2048,
            "num_hidden_layers": 8,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "intermediate_size": 6144,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        4,
        2048,
    ),
    "tiny": (
        LlamaConfig,
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
        },
        2,
        32,
    ),
    # The CPU smoke MoE. profile_experts.py tells products apart by their widths, so the expert widths (I = 40,
    # 2I = 80), the token count (96) and the routed rows (192) differ from every other width and from multiples
    # of the rank (hidden and q 64, kv 32, stacked q/k/v factors 48, experts × rank 128); the head dim equals the
    # rank, but only attention, which is classified first, has it.
    "tiny-moe": (
        Qwen3MoeConfig,
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 40,
            "intermediate_size": 128,
            "vocab_size": 256,
            "tie_word_embeddings": False,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        2,
        48,
    ),
}
DEFAULT_ROWS = ("peft-default", "peft-bf16-adapters", "loralei-unfused", "loralei-fused")
QLORA_ROWS = (
    "peft-bnb-nf4",
    "unsloth-bf16",
    "unsloth-4bit",
    "unsloth-fp8",
    "unsloth-fp8-block",
    "loralei-nf4",
    "loralei-nf4-triton",
    "loralei-int4",
    "loralei-fp8",
)
MOE_ROWS = ("peft-eager-experts",)
# PEFT's DoRA (use_dora: the weight-decomposed update, its norms recomputed in every forward), bf16 adapters.
DORA_ROWS = ("peft-dora",)
# PEFT on a GPTQ checkpoint (issue 47's peer): the GPTQ copy of the shape's checkpoint (see load_gptq).
GPTQ_ROWS = ("peft-gptq",)
# Rows that compute the loss with loralei's chunked linear cross entropy instead of the model's own loss (with
# --liger: Liger's RMSNorm and RoPE, this loss instead of Liger's fused linear cross entropy).
LCE_ROWS = ("loralei-fused-lce",)
# Axolotl's LoRA kernels (its lora_qkv_kernel, lora_o_kernel and lora_mlp_kernel settings) over a PEFT model, LoRA
# or DoRA, bf16 adapters (see axolotl_model).
AXOLOTL_ROWS = ("axolotl-lora", "axolotl-dora")
ROWS = DEFAULT_ROWS + QLORA_ROWS + GPTQ_ROWS + MOE_ROWS + LCE_ROWS + DORA_ROWS + AXOLOTL_ROWS
# PEFT rows with adapters in the model's dtype; the others keep PEFT's default (FP32 adapters), as its users get it.
PEFT_BF16_ROWS = ("peft-bf16-adapters", "peft-eager-experts", *DORA_ROWS)
# Rows that build their model with a Transformers experts implementation other than the default (grouped_mm where
# the kernel runs, else eager); they need an MoE shape.
EXPERTS_IMPLEMENTATION = {"peft-eager-experts": "eager"}
# LoRAConfig fields of the loralei QLoRA rows.
LORALEI_QLORA: dict[str, dict[str, object]] = {
    "loralei-nf4": {"quantize_base": True},
    "loralei-nf4-triton": {"quantize_base": True, "nf4_kernel": "triton"},
    "loralei-int4": {"quantize_base": True, "quantization_type": "int4", "int4_group_size": 128},
    "loralei-fp8": {"quantize_base": True, "quantization_type": "fp8"},
}
# NF4 blocks per shape where TorchAO's 64 × 256 do not divide the weights (the tiny CPU shape).
NF4_BLOCKS: dict[str, dict[str, int]] = {"tiny": {"nf4_block_size": 16, "nf4_scaler_block_size": 2}}
# GPTQ copies' group size where 128 does not divide the shape's inputs (the tiny CPU shape).
GPTQ_GROUP: dict[str, int] = {"tiny": 32}
# gptqmodel's kernel for the GPTQ rows, by device: one that trains, not the CUDA extension's (not built in the
# wheel we carry, and inference-only). Triton on CUDA is what gptqmodel's own "auto_trainable" picks there; in
# training mode it and plain torch both dequantize the whole weight with torch and call torch.matmul.
GPTQ_BACKEND = {"cuda": "gptq_triton", "cpu": "gptq_torch"}
# Rows whose models apply loralei's fused kernels, including its fused gated MLP (so no Liger SwiGLU).
FUSED_ROWS = ("loralei-fused", *LCE_ROWS, *LORALEI_QLORA)
# Rows that patch a library's classes globally when imported, so they run in a child process, one child per
# library (its rows share the import and its compile caches); the value is what the child imports first.
# gptqmodel, imported by the GPTQ rows, patches Transformers and safetensors and sets the CUDA allocator's
# PYTORCH_ALLOC_CONF (where unset) when it is imported. Axolotl's kernel patches rewrite the attention class.
ISOLATED: dict[str, str] = {
    **{row: "unsloth" for row in ("unsloth-bf16", "unsloth-4bit", "unsloth-fp8", "unsloth-fp8-block")},
    **dict.fromkeys(GPTQ_ROWS, "gptqmodel"),
    **dict.fromkeys(AXOLOTL_ROWS, "axolotl"),
}
# Unsloth's FP8 LoRA rows: its load_in_fp8 (TorchAO Float8 bases, quantized from the checkpoint by its loader),
# with per-row scales (True) or 128×128 blocks ("block").
UNSLOTH_FP8: dict[str, bool | str] = {"unsloth-fp8": True, "unsloth-fp8-block": "block"}
# Rows that can only load the shape's random-weight model from a saved checkpoint directory (the others build it
# in place when they are given none).
FROM_CHECKPOINT = ("peft-bnb-nf4", *ISOLATED)


def is_moe(shape: str) -> bool:
    """Whether the shape's layers route tokens to packed experts (no dense gate/up/down projections)."""
    return "num_experts" in SHAPES[shape][1]


def moe_layers(shape: str) -> int:
    """How many decoder layers of the shape are sparse (Qwen3-MoE's rule: every ``decoder_sparse_step``-th
    layer, counting from 1, that is not in ``mlp_only_layers``)."""
    cfg = SHAPES[shape][1]
    if not is_moe(shape):
        return 0
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers", []))
    return sum(1 for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def build_model(
    shape: str,
    device: torch.device,
    dtype: torch.dtype,
    experts_implementation: str | None = None,
    layers: int | None = None,
) -> torch.nn.Module:
    """The shape's random-weight model (seeded), SDPA attention; ``experts_implementation`` picks Transformers'
    experts forward on MoE shapes (``None``: its default); ``layers`` replaces the shape's decoder layer count."""
    config_cls, cfg, _, _ = SHAPES[shape]
    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    cfg = cfg if layers is None else {**cfg, "num_hidden_layers": layers}
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(
            config_cls(**cfg), dtype=dtype, attn_implementation="sdpa", **extra
        )
    return model.train()


def save_checkpoint(shape: str, directory: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """Saves the shape's random-weight model (``build_model``'s weights) with a tokenizer covering its vocab,
    for the rows that load a checkpoint directory the way their users do."""
    model = build_model(shape, device, dtype)
    model.save_pretrained(directory)
    del model
    release(device)
    vocab_tokenizer(SHAPES[shape][1]["vocab_size"]).save_pretrained(directory)
    return directory


def vocab_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A minimal fast tokenizer with one word per token id (loaders such as Unsloth's want a tokenizer beside
    the weights; the benchmark feeds token ids and never tokenizes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0-3; LlamaConfig's bos and eos ids are 1 and 2
    vocab = dict(zip(specials, range(len(specials)), strict=True))
    vocab |= {f"t{i}": i for i in range(len(specials), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def load_model(
    checkpoint: Path, device: torch.device, dtype: torch.dtype, experts_implementation: str | None = None
) -> torch.nn.Module:
    """The checkpoint loaded as a PEFT user loads a model (``from_pretrained`` onto the device, SDPA), with
    ``experts_implementation`` as in build_model."""
    extra = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=dtype, device_map={"": device}, attn_implementation="sdpa", **extra
    )
    return model.train()


def quantized_device_map(device: torch.device) -> dict[str, int | str]:
    """The whole model on the device, in the form the quantized loaders' users give: a CUDA device index, or "cpu"
    (the --tiny test)."""
    return {"": torch.cuda.current_device() if device.type == "cuda" else "cpu"}


def load_bnb_nf4(checkpoint: Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint loaded as PEFT QLoRA users load it: ``from_pretrained`` with a BitsAndBytesConfig. Going
    through the loader rather than swapping in bnb Linear4bit layers by hand gives exactly their model: the
    quantizer picks the layers (every decoder Linear, the 7 target projections, not lm_head), double-quantizes,
    and marks the model as 4-bit for PEFT. No prepare_model_for_kbit_training: it would upcast the
    non-quantized weights to FP32."""
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint,
        quantization_config=quant,
        dtype=dtype,
        device_map=quantized_device_map(device),
        attn_implementation="sdpa",
    )
    return model.train()


def load_gptq(checkpoint: Path, shape: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The GPTQ copy of the checkpoint (gptq_checkpoint.py writes it beside it once: ``CHECKPOINT-gptq``) loaded as
    PEFT users load a GPTQ model: ``from_pretrained``, which reads the quantization config saved with it
    (Transformers' GPTQ integration: optimum and gptqmodel); the GPTQConfig given only picks gptqmodel's kernel
    (GPTQ_BACKEND). Every decoder projection becomes a gptqmodel quantized linear, which PEFT wraps in its GPTQ
    LoRA layer."""
    import gptq_checkpoint
    from transformers import GPTQConfig

    gptq_dir = gptq_checkpoint.convert_beside(checkpoint, GPTQ_GROUP.get(shape, 128))
    model = AutoModelForCausalLM.from_pretrained(
        gptq_dir,
        quantization_config=GPTQConfig(bits=4, backend=GPTQ_BACKEND[device.type]),
        dtype=dtype,
        device_map=quantized_device_map(device),
        attn_implementation="sdpa",
    )
    return model.train()


def unsloth_model(row: str, shape: str, checkpoint: Path, checkpointing: bool) -> torch.nn.Module:
    """Unsloth's QLoRA (``unsloth-4bit``), FP8 (UNSLOTH_FP8: ``load_in_fp8``, which quantizes the checkpoint
    with TorchAO into a directory of its own and loads that) or bf16 LoRA model as its documentation sets it up;
    Unsloth loads only from a directory, and keeps FP32 LoRA factors. On MoE shapes the same seven names: Unsloth turns
    gate/up/down into its own target_parameters on the experts' banks."""
    from unsloth import FastLanguageModel

    ckpt = "unsloth" if checkpointing else False  # Unsloth's offloaded checkpointing when on
    model, _ = FastLanguageModel.from_pretrained(
        model_name=str(checkpoint),
        max_seq_length=SHAPES[shape][3],
        dtype=torch.bfloat16,
        load_in_4bit=row == "unsloth-4bit",
        load_in_fp8=UNSLOTH_FP8.get(row, False),
        use_gradient_checkpointing=ckpt,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=TARGETS,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing=ckpt,
        random_state=0,
    )
    FastLanguageModel.for_training(model, use_gradient_checkpointing=ckpt)
    return model


def _axolotl_lora_kernels():
    """Axolotl's ``monkeypatch.lora_kernels`` module, imported without the trainer-callbacks package it takes one
    helper from (that package's ``__init__`` imports W&B, evaluate, datasets and pandas, none of which the
    kernels use): the helper's own module is loaded alone."""
    import importlib
    import types

    import axolotl.utils

    callbacks = types.ModuleType("axolotl.utils.callbacks")
    callbacks.__path__ = [str(Path(axolotl.utils.__file__).parent / "callbacks")]
    sys.modules.setdefault("axolotl.utils.callbacks", callbacks)
    importlib.import_module("axolotl.utils.callbacks.models")
    return importlib.import_module("axolotl.monkeypatch.lora_kernels")


def axolotl_model(
    row: str, shape: str, checkpoint: Path, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """Axolotl's LoRA kernels as its ``lora_qkv_kernel``, ``lora_o_kernel`` and ``lora_mlp_kernel`` settings apply
    them: the attention class's forward rewritten to call fused q/k/v and o autograd functions, the MLP's forward
    replaced by its SwiGLU LoRA kernel, DoRA's norms in Triton, all on a PEFT model of the checkpoint with bf16
    adapters (as the PEFT rows the bars name). Its MLP kernel allocates on CUDA only: on the CPU (the --tiny test)
    the MLP stays PEFT's."""
    if is_moe(shape):
        raise ValueError(f"{row}: Axolotl's kernels here patch dense MLPs; pick a dense shape, not {shape}")
    from peft import get_peft_model

    lora_kernels = _axolotl_lora_kernels()
    cfg = lora_kernels.DictDefault(
        base_model=str(checkpoint),
        lora_qkv_kernel=True,
        lora_o_kernel=True,
        lora_mlp_kernel=device.type == "cuda",
    )
    lora_kernels.patch_self_attn_lora(cfg)
    model = load_model(checkpoint, device, dtype)
    config = peft_config(shape, dora=row == "axolotl-dora")
    model = get_peft_model(model, config, autocast_adapter_dtype=False)
    return lora_kernels.apply_lora_kernel_patches(model, cfg)


def model_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own loss with the ids as labels (Liger's fused linear cross entropy when Liger patched it)."""
    return model(input_ids=ids, labels=ids).loss


def lce_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The same mean loss through loralei's chunked linear cross entropy (the runner's loss: linear_cross_entropy)."""
    return linear_cross_entropy_loss(model, {"input_ids": ids}, ids, ids.shape[0] * (ids.shape[1] - 1))


def row_loss(row: str) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    """How the row computes its loss from the model and the ids."""
    return lce_loss if row in LCE_ROWS else model_loss


def loralei_config(row: str, shape: str) -> LoRAConfig:
    """The row's LoRAConfig (QLoRA rows: quantized bases, with blocks that fit the shape; MoE shapes: the
    attention projections and the experts' banks)."""
    extra = LORALEI_QLORA.get(row, {})
    if extra.get("quantize_base") and extra.get("quantization_type", "nf4") == "nf4":
        extra = {**extra, **NF4_BLOCKS.get(shape, {})}
    targets = MOE_TARGETS if is_moe(shape) else {"target_modules": TARGETS}
    return LoRAConfig(r=RANK, lora_alpha=ALPHA, **targets, **extra)


def peft_config(shape: str, dora: bool = False):
    """PEFT's LoraConfig for the shape (MoE shapes: the experts' banks through ``target_parameters``), DoRA's with
    ``dora``."""
    from peft import LoraConfig

    if is_moe(shape):
        targets = {"target_modules": ATTENTION_TARGETS, "target_parameters": PEFT_EXPERT_PARAMETERS}
    else:
        targets = {"target_modules": TARGETS}
    return LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM", use_dora=dora, **targets
    )


def add_adapter(model: torch.nn.Module, row: str, shape: str) -> torch.nn.Module:
    if row.startswith("peft"):
        from peft import get_peft_model

        config = peft_config(shape, dora=row in DORA_ROWS)
        return get_peft_model(model, config, autocast_adapter_dtype=row not in PEFT_BF16_ROWS)
    inject_lora(model, loralei_config(row, shape))
    if row in FUSED_ROWS:
        print(apply_fused_kernels(model))
    return model


def apply_liger(model: torch.nn.Module, row: str, shape: str) -> None:
    """Liger's RMSNorm, RoPE and fused linear cross entropy, and its SwiGLU MLP where the row has no fused MLP of
    its own. MoE shapes keep their experts: Liger's SwiGLU there replaces the whole experts forward (its own fused
    MoE), which would take the part being compared out of every row."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    swiglu = row not in FUSED_ROWS and not is_moe(shape)
    _apply_liger_kernel_to_instance(
        model=model, rms_norm=True, rope=True, swiglu=swiglu, fused_linear_cross_entropy=True
    )


def prepared_model(
    shape: str,
    row: str,
    liger: bool,
    checkpointing: bool,
    device: torch.device,
    dtype: torch.dtype,
    checkpoint: Path | None = None,
) -> torch.nn.Module:
    """The model of one benchmark row: random weights, Liger (optional), the row's adapter, checkpointing.
    With ``checkpoint`` every row loads the shape's weights from that directory (see save_checkpoint), as its
    users load a model; without it the model is built in place (rows in FROM_CHECKPOINT need one)."""
    if row.startswith(("unsloth", "axolotl")) and liger:
        raise ValueError(f"{row} brings its own kernels; run it without --liger")
    if row.startswith("unsloth"):
        return unsloth_model(row, shape, checkpoint, checkpointing)
    if row in AXOLOTL_ROWS:
        model = axolotl_model(row, shape, checkpoint, device, dtype)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if row in EXPERTS_IMPLEMENTATION and not is_moe(shape):
        raise ValueError(f"{row} sets the experts implementation: it needs an MoE shape, not {shape}")
    if row == "peft-bnb-nf4":
        model = load_bnb_nf4(checkpoint, device, dtype)
    elif row in GPTQ_ROWS:
        model = load_gptq(checkpoint, shape, device, dtype)
    elif checkpoint is not None:
        model = load_model(checkpoint, device, dtype, EXPERTS_IMPLEMENTATION.get(row))
    else:
        model = build_model(shape, device, dtype, EXPERTS_IMPLEMENTATION.get(row))
    if liger:
        apply_liger(model, row, shape)
    model = add_adapter(model, row, shape)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def release(device: torch.device) -> None:
    """Returns freed model memory to the device before the next row is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
