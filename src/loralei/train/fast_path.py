"""Fast by default: what the ``auto`` speed settings become on the run's device, and why.

Packed rows of at least ``FLEX_AUTO_TOKENS`` on CUDA, with no attention backend set, run ``flex_attention``.
``training.liger_kernel: auto`` (the default) applies Liger's RMSNorm, RoPE and SwiGLU on CUDA when
``liger-kernel`` is installed and ``training.fused_lora`` is off; the fused path (the default) brings loralei's
own RMSNorm, RoPE and gated-MLP kernels. ``training.loss: auto`` (the default) is loralei's
``linear_cross_entropy`` on CUDA (the head and the loss in chunks, never the full logits), unless the model's
head or config rules it out, and ``cross_entropy`` elsewhere. ``training.cuda_graphs: auto`` (the default)
replays each micro batch's forward and backward from a CUDA graph (:mod:`loralei.train.graphs`) on CUDA in one
process, when every batch has one shape and nothing in the step needs the host or random numbers; the runner's
own batches get one shape from ``pad_to_max_length``, or, where a micro batch is small enough that the host sets
its pace (:func:`padding_refusal`), by padding every batch to the data's widest row. The fused
LoRA kernels (``training.fused_lora``) are on by default everywhere. Explicit values are kept as given (an
explicit ``cuda_graphs: true`` that cannot run is an error). The lines saying what ``auto`` chose and why are
the run's first lines.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from ..errors import ConfigError
from ..inject import count_parameters
from . import graphs, kept_attention, shared_prompt
from .losses import head_refusal
from .schema import RunConfig, TrainingSection

# packed rows at least this long get flex_attention when no attention backend is set (their sdpa mask: 256 MiB a
# row at 16K tokens, 1 GiB at 32K)
FLEX_AUTO_TOKENS = 16384
# A micro batch of at most this many FLOPs a decoder layer (6 × parameters × tokens / layers) takes an H100 or H200
# less time to run than the host takes to launch its eager step: Qwen3-0.6B's DPO step (1.05e12 at 8,192 tokens)
# ran 2.45× faster replayed than launched eagerly on an H100 (one call), its SFT step (2.09e12 at 16,384) about
# 2.3× on an H200 (122,859 tok/s graphed in the bar's call, 52,882 eager in an earlier one).
# Padding such a batch to the data's widest row for CUDA graphs costs less than the graphs save.
HOST_BOUND_LAYER_FLOPS = 2.5e12
# the GPUs those steps were measured on (compute capability 9: Hopper); slower ones run a padded batch longer
HOST_BOUND_MIN_CAPABILITY = 9


def _liger(t: TrainingSection, device: torch.device) -> tuple[bool, str | None]:
    """Whether Liger's kernels are applied, and the reason when ``auto`` chose."""
    requested, loss, fused = t.liger_kernel, t.loss, t.fused_lora
    if requested != "auto":
        return bool(requested), None
    if device.type != "cuda":
        return False, "off: no CUDA device"
    if t.sequence_parallel_size > 1:
        return (
            False,
            "off: training.sequence_parallel_size > 1 (Liger's loss would shift each shard's labels)",
        )
    if fused:
        return False, "off: loralei's own kernels run RMSNorm, RoPE and the gated MLP (training.fused_lora)"
    if loss == "cut_cross_entropy":
        return False, "off: training.loss cut_cross_entropy replaces Liger's loss"
    if importlib.util.find_spec("liger_kernel") is None:
        return False, "off: liger-kernel is not installed (pip install 'loralei[liger]')"
    return True, "on (RMSNorm, RoPE, SwiGLU): CUDA, liger-kernel installed, training.fused_lora off"


def _loss(model: nn.Module, device: torch.device) -> tuple[str, str]:
    """The loss ``auto`` chooses for ``model`` on ``device``, and why."""
    if device.type != "cuda":
        return "cross_entropy", f"{device.type}: the plain head and loss"
    if (refusal := head_refusal(model, "linear_cross_entropy")) is not None:
        return "cross_entropy", f"not linear_cross_entropy: {refusal.split('; use')[0]}"
    return "linear_cross_entropy", "CUDA: the head and the loss in chunks, never the full logits"


def _with(cfg: RunConfig, **training: object) -> RunConfig:
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=training)})


def resolve_liger(cfg: RunConfig, device: torch.device) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``training.liger_kernel`` made concrete for ``device`` (before the model is built, which
    Liger patches), and the note saying what ``auto`` chose."""
    t = cfg.training
    liger, why = _liger(t, device)
    return _with(cfg, liger_kernel=liger), [f"training.liger_kernel: auto -> {why}"] if why else []


def resolve_attention(cfg: RunConfig, device: torch.device, own_model: bool) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``model.attn_implementation`` set to ``flex_attention`` where neither attention field is set,
    rows are packed and long (at least :data:`FLEX_AUTO_TOKENS`), the runner loads the model (``own_model``: the
    caller passed one, built with its own attention) and the device is CUDA; and the note saying so."""
    t = cfg.training
    unset = t.attn_implementation is None and cfg.model.attn_implementation is None
    long_packed = t.packing and t.max_seq_length >= FLEX_AUTO_TOKENS
    if not (unset and long_packed and not own_model and device.type == "cuda"):
        return cfg, []
    model = cfg.model.model_copy(update={"attn_implementation": "flex_attention"})
    note = (
        f"attention: flex_attention for packed rows of up to {t.max_seq_length} tokens (a block-sparse document "
        "mask; sdpa would hold an L×L mask per row); set model.attn_implementation to choose"
    )
    return cfg.model_copy(update={"model": model}), [note]


def resolve_loss(cfg: RunConfig, model: nn.Module, device: torch.device) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``training.loss`` made concrete for ``model`` on ``device``, and the note saying what
    ``auto`` chose."""
    if cfg.training.objective != "sft":  # log-probabilities from loralei's chunked head (train/preference/)
        return cfg, []
    if cfg.training.loss != "auto":
        return cfg, []
    loss, why = _loss(model, device)
    return _with(cfg, loss=loss), [f"training.loss: auto -> {loss} ({why})"]


def _graphs_refusal(cfg: RunConfig, model: nn.Module, device: torch.device, distributed: bool) -> str | None:
    """Why no step of this run can replay a CUDA graph, or None."""
    if device.type != "cuda":
        return "no CUDA device"
    if distributed:
        return "DDP and FSDP2 run gradient hooks on the host in every backward"
    if cfg.training.torch_compile:
        return "torch_compile runs its own graphs"
    if cfg.training.layer_offloading:
        return "training.layer_offloading moves the layers' weights to new addresses every step"
    if cfg.model.dtype == "float16":
        return "float16's loss scaler checks the gradients on the host"
    if cfg.lora.qat is not None:
        return "lora.qat's fake quantization (TorchAO's NF4 and int4 recipes among it) is not checked under capture"
    if kept_attention.keeps(cfg.training.gradient_checkpointing, cfg.training.max_seq_length):
        return (
            f"offloaded rows of {kept_attention.AUTO_TOKENS:,} tokens or more keep attention and projection outputs in host "
            "memory: a capture cannot reuse the device memory each layer's come back in (the 8B shape at 65,536 "
            "tokens ran out of an H200's 140 GiB), and a step of seconds gains nothing from a replay"
        )
    if cfg.training.objective != "sft" and shared_prompt.requested(cfg) is True:
        return "preference.share_prompt: true stores each pair in a row of its own width"
    if cfg.training.liger_kernel is True and cfg.training.loss != "linear_cross_entropy":
        return "Liger's fused linear cross entropy reads the token count on the host"
    return graphs.refusal(model)


def padding_refusal(model: nn.Module, device: torch.device, tokens: int | None) -> str | None:
    """Why the runner's batches should not be padded to one width for CUDA graphs, or None where a micro batch
    of ``tokens`` tokens so padded is small enough for ``model`` that the host, not the GPU, sets the pace of its
    eager step (:data:`HOST_BOUND_LAYER_FLOPS`)."""
    varying = "batch widths vary with training.pad_to_max_length: false"
    fix = "set it to true for graphs"
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if tokens is None or not layers:
        return f"{varying} ({fix})"
    if torch.cuda.get_device_capability(device)[0] < HOST_BOUND_MIN_CAPABILITY:
        return f"{varying}, and padding them to one width pays where measured, on Hopper GPUs ({fix})"
    if 6 * count_parameters(model).total * tokens / layers > HOST_BOUND_LAYER_FLOPS:
        return (
            f"{varying}, and padding them to the data's widest row ({tokens:,} tokens a micro batch) would cost "
            f"this model more than graphs save ({fix})"
        )
    return None


def pads_batches(cfg: RunConfig, own_batches: bool) -> bool:
    """Whether the runner pads every batch to its data's widest row: graphs replay its own batches, which
    ``pad_to_max_length`` does not already give one width."""
    return cfg.training.cuda_graphs is True and not own_batches and not cfg.training.pad_to_max_length


def resolve_cuda_graphs(
    cfg: RunConfig,
    model: nn.Module,
    device: torch.device,
    *,
    distributed: bool,
    own_batches: bool,
    padded_tokens: int | None = None,
) -> tuple[RunConfig, list[str]]:
    """``cfg`` with ``training.cuda_graphs`` made concrete, and the note saying what ``auto`` chose.

    Args:
        distributed: the run has several processes (or DDP / FSDP2 in one).
        own_batches: the caller collates the batches, so their shapes are not known in advance (``auto`` turns
            graphs on; shapes that repeat get them). The runner's own batches have one shape with
            ``training.pad_to_max_length: true``, or padded to the data's widest row (:func:`pads_batches`),
            which ``auto`` does unless :func:`padding_refusal` says why not.
        padded_tokens: the tokens of the runner's micro batch with every row as wide as the data's widest.

    Raises:
        ConfigError: ``cuda_graphs: true`` for a run that cannot replay graphs.
    """
    requested = cfg.training.cuda_graphs
    if requested is False:
        return cfg, []
    refused = _graphs_refusal(cfg, model, device, distributed)
    if requested is True:
        if refused is not None:
            raise ConfigError(
                f"training.cuda_graphs: true cannot run here: {refused}; set cuda_graphs: auto or false"
            )
        return cfg, []
    padded = not own_batches and not cfg.training.pad_to_max_length
    if refused is None and padded:
        refused = padding_refusal(model, device, padded_tokens)
    if refused is not None:
        return _with(cfg, cuda_graphs=False), [f"training.cuda_graphs: auto -> off: {refused}"]
    shape = (
        f"every batch padded to the data's widest row ({padded_tokens:,} tokens a micro batch, few enough for "
        "this model that the host, not the GPU, sets an eager step's pace)"
        if padded
        else "batches of one shape"
    )
    why = f"on: CUDA, one process, {shape}; each micro batch's forward and backward replay a graph"
    return _with(cfg, cuda_graphs=True), [f"training.cuda_graphs: auto -> {why}"]
