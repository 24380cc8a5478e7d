"""Building a run's parts from its config: model, tokenizer, optimizer, output directory (the data:
:mod:`.build_data`)."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..checkpoint import read_initial_factors
from ..config import LoRAConfig
from ..errors import ConfigError, InjectionError, LoraleiError
from ..hub import check_source, offline
from ..inject import (
    drop_input_grad_hooks,
    find_parameter_targets,
    find_targets,
    inject_lora,
    lora_expert_modules,
    lora_modules,
)
from ..modules.principal_init import is_principal
from ..modules.quantized.checkpoint_formats import FORMATS, QuantSpec
from ..principal_adapter import inject_from_initial
from . import (
    dora_stash,
    kept_attention,
    layer_offload,
    layered_load,
    quantized_checkpoint,
    sequence_parallel,
    tiled_mlp,
)
from .checkpointing import enable_checkpointing, offload_inputs_problem
from .compile import compile_layers
from .losses import apply_liger, missing_package_error
from .metrics import require_wandb
from .model_config import overridden_config
from .schema import RunConfig, tiled_mlp_refusals

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_optional_dependencies(cfg: RunConfig) -> None:
    """Fails early, before any loading, when an option needs a package that is not installed.

    Raises:
        ConfigError: naming the option and the package to install.
    """
    needs = {
        "training.liger_kernel": ("liger_kernel", "liger", cfg.training.liger_kernel is True),
        "training.loss: cut_cross_entropy": (
            "cut_cross_entropy",
            "cce",
            cfg.training.loss == "cut_cross_entropy",
        ),
        "training.report_to: tensorboard": (
            "tensorboard",
            "tensorboard",
            "tensorboard" in cfg.training.report_to,
        ),
    }
    for field, (module, extra, wanted) in needs.items():
        if wanted and importlib.util.find_spec(module) is None:
            raise missing_package_error(field, module, extra)
    if cfg.wandb_settings is not None:
        require_wandb()


def seed_everything(seed: int) -> None:
    """Seeds python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_device() -> torch.device:
    """This process's CUDA device (the one ``torch.cuda.set_device`` chose, e.g. per torchrun rank) when there
    is CUDA, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def resolve_dtype(name: str) -> torch.dtype:
    """``auto`` is bfloat16 on a CUDA device that supports it, else float32."""
    if name == "auto":
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return _DTYPES[name]


def check_config_fits(cfg: RunConfig, config: Any, dtype: torch.dtype, device: torch.device) -> None:
    """Refuses, from the model's config before its weights load, what its sizes rule out: a full batch's layer
    inputs that would not fit in pinned host memory under ``gradient_checkpointing: offload`` on CUDA
    (:func:`~loralei.train.checkpointing.offload_inputs_problem`), and more ranks per sequence than attention heads
    (:func:`~loralei.train.sequence_parallel.heads_refusal`).

    Raises:
        ConfigError: the problem, with the sizes and the settings that fix it.
    """
    t = cfg.training
    offload = t.gradient_checkpointing == "offload" and device.type == "cuda"
    if not offload and t.sequence_parallel_size == 1:
        return
    text = config.get_text_config()
    layers, hidden = getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)
    heads = getattr(text, "num_attention_heads", None)
    # a config that does not give a size: nothing to check against
    if offload and None not in (layers, hidden):
        # a rank of a sequence-parallel group holds its share of each row
        tokens = t.batch_size * -(-t.max_seq_length // t.sequence_parallel_size)
        if (problem := offload_inputs_problem(layers, tokens, hidden * dtype.itemsize)) is not None:
            raise ConfigError(problem)
    if heads is not None and (problem := sequence_parallel.heads_refusal(heads, t.sequence_parallel_size)):
        raise ConfigError(problem)


def load_tokenizer(cfg: RunConfig) -> Any:
    """The tokenizer of ``model.tokenizer`` (default: the model's own directory or hub name)."""
    from transformers import AutoTokenizer

    # Errors name the key that gave the source: model.tokenizer when set, else the model's own path.
    key, source = (
        ("model.tokenizer", cfg.model.tokenizer)
        if cfg.model.tokenizer
        else ("model.name_or_path", cfg.model.name_or_path)
    )
    cached_only = check_source(key, source, revision=cfg.model.revision)
    try:
        with offline(cached_only):
            return AutoTokenizer.from_pretrained(
                source, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code
            )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot load a tokenizer from {source!r}: {exc}") from None


def load_model(cfg: RunConfig, device: torch.device) -> tuple[nn.Module, str | None]:
    """Loads the base causal LM in the configured dtype and attention backend, and the line saying how: a GPTQ,
    AWQ or NVFP4 checkpoint is read by loralei, one decoder layer at a time, its quantized linears kept as stored
    (:mod:`.quantized_checkpoint`); a base to be packed (``lora.quantize_base``) or streamed
    (``training.layer_offloading``) is read one decoder layer at a time, packed as it arrives
    (:mod:`.layered_load`), where its checkpoint allows; else Transformers loads it whole.

    Raises:
        ConfigError: the model cannot be found or loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    m = cfg.model
    cached_only = check_source("model.name_or_path", m.name_or_path, revision=m.revision)
    source = {"revision": m.revision, "trust_remote_code": m.trust_remote_code}
    try:
        with offline(cached_only):
            config = AutoConfig.from_pretrained(m.name_or_path, **source)
            if m.config_overrides:  # a ConfigError names the override
                config = overridden_config(config, m.config_overrides)
            check_config_fits(cfg, config, resolve_dtype(m.dtype), device)
            spec = quantized_checkpoint.checkpoint_spec(config, f"model.name_or_path {m.name_or_path!r}")
            if spec is not None:
                return _load_quantized_checkpoint(cfg, config, spec), (
                    f"model: a {FORMATS[spec.method].title} checkpoint, read one decoder layer at a time, its "
                    "quantized linears kept as stored"
                )
            why = None
            if cfg.lora.quantize_base or cfg.training.layer_offloading:
                loaded = _load_by_layers(cfg, config, device)
                if isinstance(loaded, nn.Module):
                    packed = ", each packed as it arrived" if cfg.lora.quantize_base else ""
                    return loaded, f"model: read one decoder layer at a time{packed}"
                why = f"model: loaded whole first ({loaded})"
            model = AutoModelForCausalLM.from_pretrained(
                m.name_or_path,
                dtype=resolve_dtype(m.dtype),
                attn_implementation=cfg.attn_implementation,
                config=config,
                **source,
            )
            return model, why
    except LoraleiError:  # a config override's or a target's, already naming its field
        raise
    except (OSError, ValueError, ImportError) as exc:
        raise ConfigError(f"model.name_or_path: cannot load {m.name_or_path!r}: {exc}") from None


def _checkpoint_files(cfg: RunConfig) -> layered_load.SafetensorsDirectory | str:
    """The model's safetensors files (a hub name's from the cache, or downloaded now), or why there are none."""
    from huggingface_hub import snapshot_download

    m = cfg.model
    directory = Path(m.name_or_path)
    if not directory.is_dir():  # a hub name: its safetensors files, from the cache or downloaded now
        try:
            directory = Path(
                snapshot_download(
                    m.name_or_path,
                    revision=m.revision,
                    allow_patterns=["*.safetensors", layered_load.INDEX],  # offline(): from the cache
                )
            )
        except (OSError, ValueError) as exc:
            return f"its safetensors files could not be fetched: {exc}"
    files = layered_load.SafetensorsDirectory(directory)
    return files if files.names() else "no safetensors checkpoint"


def _load_by_layers(cfg: RunConfig, config: Any, device: torch.device) -> nn.Module | str:
    """The model read (and packed) one decoder layer at a time (:func:`layered_load.load_by_layers`), or why
    its checkpoint cannot be read so."""
    m = cfg.model
    if cfg.lora.target_parameters:
        return "lora.target_parameters: expert banks are adapted after loading"
    if getattr(config, "quantization_config", None) is not None:
        return "the checkpoint is quantized already: Transformers reads its layout"
    if cfg.lora.quantize_base and is_principal(cfg.lora.init_lora_weights):
        return f"lora.init_lora_weights: {cfg.lora.init_lora_weights}: the residual is packed, not the weights read"
    files = _checkpoint_files(cfg)
    if isinstance(files, str):
        return files
    model = layered_load.empty_model(
        config, resolve_dtype(m.dtype), cfg.attn_implementation, m.trust_remote_code
    )
    if (why := layered_load.mismatch(model, files)) is not None:
        return why
    _check_targets(model, cfg.lora)  # as injection names them, before anything is read
    # packed layers stay in host memory when they stream from there
    keep = torch.device("cpu") if cfg.training.layer_offloading else device
    layered_load.load_by_layers(model, files, _lora_for_device(cfg, device), keep)
    return model


def _load_quantized_checkpoint(cfg: RunConfig, config: Any, spec: QuantSpec) -> nn.Module:
    """A GPTQ, AWQ or NVFP4 checkpoint read one decoder layer at a time into host memory, its quantized linears
    kept as stored (:func:`quantized_checkpoint.load`).

    Raises:
        ConfigError: what :func:`quantized_checkpoint.refuse_options` and :func:`quantized_checkpoint.load` refuse,
            or no safetensors files; before any tensor is read.
    """
    m, source = cfg.model, f"model.name_or_path {cfg.model.name_or_path!r}"
    quantized_checkpoint.refuse_options(cfg.lora, spec, source)
    files = _checkpoint_files(cfg)
    if isinstance(files, str):
        raise ConfigError(
            f"{source}: a quantized checkpoint is read from its safetensors files, but there is {files}"
        )
    stripped = quantized_checkpoint.without_quantization(config)
    dtype = resolve_dtype(m.dtype)
    model = layered_load.empty_model(stripped, dtype, cfg.attn_implementation, m.trust_remote_code)
    quantized_checkpoint.load(model, files, spec, cfg.lora, dtype, source, check_targets=_check_targets)
    return model


def _apply_fusion(model: nn.Module, cfg: RunConfig) -> str:
    try:
        from .. import apply_fused_kernels
    except ImportError:
        return "fused LoRA kernels are not part of this loralei build; the plain LoRA path runs"
    groups = cfg.training.fused_shared_input_lora
    # true: the family's own groups (q/k/v, gate/up); false: every projection alone; a list: exactly those.
    shared = "auto" if groups is True else [g.model_dump() for g in groups] if groups else None
    report = apply_fused_kernels(model, mlp=True, qkv=bool(groups), o=True, shared_input_groups=shared)
    return str(report)


def _lora_for_device(cfg: RunConfig, device: torch.device) -> LoRAConfig:
    """Quantized bases are packed on the run's device, one weight at a time, unless the config names a device:
    the dense model never has to fit there, and packing on a GPU is far faster than on the CPU."""
    lora = cfg.lora
    if lora.quantize_base and lora.quantization_device is None and device.type != "cpu":
        return lora.model_copy(update={"quantization_device": str(device)})
    return lora


def _check_targets(model: nn.Module, lora: LoRAConfig) -> None:
    """Raises ``inject_lora``'s target errors, prefixed with the YAML field that selected nothing or the wrong
    thing (``lora.target_modules: ...``, ``lora.target_parameters: ...``)."""
    for field, find in (("target_modules", find_targets), ("target_parameters", find_parameter_targets)):
        try:
            find(model, lora)
        except InjectionError as exc:
            raise InjectionError(f"lora.{field}: {str(exc).removeprefix(field + ' ')}") from None


def _inject(model: nn.Module, lora: LoRAConfig, resume: Path | None = None) -> None:
    """``inject_lora``, its target errors named as :func:`_check_targets` names them; the model is unchanged when
    they are raised. Resuming a PiSSA/OLoRA run, the modules start from the checkpoint's initial factors: the
    residual base is rebuilt as the run first made it, not decomposed again."""
    _check_targets(model, lora)
    if resume is not None and is_principal(lora.init_lora_weights):
        adapter = resume / "adapter"
        inject_from_initial(model, lora, read_initial_factors(adapter), adapter)
    else:
        inject_lora(model, lora)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def adapter_coverage(model: nn.Module) -> str:
    """What the injected adapter covers, e.g. ``8 linear modules and 4 expert banks (2 experts modules of 8
    experts)``."""
    covers = []
    if linear := sum(1 for _ in lora_modules(model)):
        covers.append(_plural(linear, "linear module"))
    if experts := [m for _, m in lora_expert_modules(model)]:
        banks = sum(len(m.adapted) for m in experts)
        sizes = "/".join(str(n) for n in sorted({m.num_experts for m in experts}))
        covers.append(
            f"{_plural(banks, 'expert bank')} ({_plural(len(experts), 'experts module')} of {sizes} experts)"
        )
    return " and ".join(covers) or "no modules"


FLEX_MIN_HEAD_DIM = 16  # PyTorch's flex attention kernels take heads of at least this many dims


def _check_flex(model: nn.Module, device: torch.device) -> None:
    """Refuses, before training, a flex-attention run PyTorch cannot do: on another device than CUDA (no
    backward there), or with attention heads narrower than :data:`FLEX_MIN_HEAD_DIM`.

    Raises:
        ConfigError: naming the field, the value and the fix.
    """
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim < FLEX_MIN_HEAD_DIM:
        raise ConfigError(
            f"model.attn_implementation: flex_attention needs attention heads of at least {FLEX_MIN_HEAD_DIM} "
            f"dims (PyTorch's flex kernels), this model's have {head_dim}; set model.attn_implementation: sdpa"
        )
    if device.type != "cuda":
        raise ConfigError(
            f"model.attn_implementation: flex_attention trains on CUDA only (PyTorch has no {device.type} backward "
            "for it); use sdpa here"
        )


def prepare_model(
    model: nn.Module, cfg: RunConfig, device: torch.device, resume: Path | None = None
) -> list[str]:
    """Liger (optional), LoRA injection, fused kernels, gradient checkpointing, layer offloading, compile; returns
    notes. ``resume``: the checkpoint the run continues from (a PiSSA/OLoRA adapter starts from its factors).

    The output head and every base weight stay frozen; only the LoRA factors train.
    """
    if cfg.attn_implementation == "flex_attention":
        _check_flex(model, device)
    notes = []
    if cfg.training.liger_kernel is True:  # "auto" is resolved by fast_path.resolve_liger first
        fused = cfg.training.fused_lora  # loralei's kernels take RMSNorm, RoPE and the gated MLP over
        apply_liger(model, layers=not fused)
        ours = "fused linear cross entropy" + ("" if fused else ", RMSNorm, RoPE, SwiGLU")
        notes.append(f"Liger kernels applied ({ours})")
    _inject(model, _lora_for_device(cfg, device), resume)
    if cfg.training.layer_offloading:  # the layers' frozen weights go from where they were loaded to the host
        layer_offload.to_device_but_streamed(model, device)
    else:
        model.to(device)
    if cfg.training.fused_lora:
        notes.append(_apply_fusion(model, cfg))
    if (note := _tile_mlps(model, cfg)) is not None:
        notes.append(note)
    # nothing reads the embeddings' gradient, and no checkpoint here needs their output to require one: the
    # first layer's input gradient is not formed, and the backward does not hold the embeddings' output
    drop_input_grad_hooks(model)
    if cfg.training.gradient_checkpointing:
        # with compile, selective where this Transformers allows it (enable_checkpointing says where)
        notes += enable_checkpointing(
            model,
            compiled=cfg.training.torch_compile,
            offload=cfg.training.gradient_checkpointing == "offload",
            keep_attention=kept_attention.keeps(
                cfg.training.gradient_checkpointing,
                cfg.training.max_seq_length,
                cfg.training.sequence_parallel_size,
            ),
        )
    # without checkpointing, the DoRA ops' saved outputs in host memory (compiled layers keep them as they are)
    elif not cfg.training.torch_compile and (note := dora_stash.stash_outputs(model)) is not None:
        notes.append(note)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    if cfg.training.layer_offloading:  # last of the changes to the layers: it streams what they hold now
        notes.append(layer_offload.offload_layers(model, device))
    if cfg.training.torch_compile:
        notes.append(compile_layers(model))
    return notes


def _tile_mlps(model: nn.Module, cfg: RunConfig) -> str | None:
    """Tiles the MLPs as ``training.tiled_mlp`` says (``auto``: rows of at least ``tiled_mlp.AUTO_TOKENS``);
    the line saying so, or why ``auto`` stayed off for such rows."""
    t = cfg.training
    if t.tiled_mlp is False or (t.tiled_mlp == "auto" and t.max_seq_length < tiled_mlp.AUTO_TOKENS):
        return None
    if t.tiled_mlp == "auto" and (refusals := tiled_mlp_refusals(cfg)):
        return f"training.tiled_mlp: auto -> off: {refusals[0]}"
    tokens = tiled_mlp.tile_tokens(model)
    count = tiled_mlp.install(model, tokens)
    why = f"auto -> on (rows of up to {t.max_seq_length} tokens)" if t.tiled_mlp == "auto" else "true"
    return f"training.tiled_mlp: {why}: {count} MLPs run in tiles of {tokens} tokens"


def total_steps(cfg: RunConfig, batches_per_epoch: int) -> int:
    """``max_steps``, else enough optimizer steps for ``num_epochs`` passes over the data."""
    if cfg.training.max_steps is not None:
        return cfg.training.max_steps
    micro = math.ceil(cfg.training.num_epochs * batches_per_epoch)
    return max(1, math.ceil(micro / cfg.training.gradient_accumulation_steps))


def build_optimizer(cfg: RunConfig, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """Optimizer and LR schedule from ``loralei.train.optim``."""
    from .optim import build_optimizer as make_optimizer
    from .optim import build_scheduler

    o = cfg.optimizer
    optimizer = make_optimizer(
        model,
        o.name,
        lr=o.lr,
        weight_decay=o.weight_decay,
        betas=o.betas,
        eps=o.eps,
        loraplus_lr_ratio=o.loraplus_lr_ratio,
        kwargs=o.kwargs,
    )
    warmup = o.warmup_steps if o.warmup_ratio is None else round(o.warmup_ratio * steps)
    scheduler = build_scheduler(
        optimizer, schedule=o.schedule, warmup_steps=warmup, total_steps=steps, min_lr_ratio=o.min_lr_ratio
    )
    return optimizer, scheduler
