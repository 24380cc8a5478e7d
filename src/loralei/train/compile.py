"""``training.torch_compile``: the decoder layers compile one by one, and with gradient checkpointing a
selective policy keeps the matmul outputs and recomputes only the cheap ops.

One layer at a time: every layer runs the same code, so one compiled graph serves them all (parameters are graph
inputs), compile time does not grow with depth, and whatever Dynamo cannot trace (MoE routing, the plain
dequantizing linear of a quantized base) breaks a small graph instead of the whole model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..ops import lora_w, shared_input  # noqa: F401  (registers the loralei custom ops kept below)

_aten = torch.ops.aten
# Outputs kept through a checkpointed layer: attention and plain matmuls, which cost far more to recompute than
# the elementwise ops (norms, RoPE, activations) recomputed instead. Not ``addmm``: inside the fused ops an
# ``addmm`` writes the LoRA term that the base GEMM then accumulates into, in place, and a kept tensor must
# never change afterwards (checkpointing refuses it). The fused ops' own outputs are kept where they are
# single ops (their custom ops, under torch.compile).
_SAVED_OPS = {
    _aten.mm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.loralei.lora_w.default,
    torch.ops.loralei.lora_group.default,
}


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's list of decoder layers: the ``nn.ModuleList`` holding ``config.num_hidden_layers`` blocks
    of one class; ``None`` when there is no such list."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and len({type(m) for m in module}) == 1:
            return module
    return None


def compile_layers(model: nn.Module) -> str:
    """Compiles each decoder layer (the whole model where no layer list is found); returns a note for the run."""
    layers = decoder_layers(model)
    if layers is None:
        model.compile()
        return "model compiled with torch.compile (no decoder-layer list found)"
    for layer in layers:
        layer.compile()
    return f"{len(layers)} decoder layers compiled one by one with torch.compile"


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint``: matmul and attention outputs saved, the rest recomputed."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def checkpoint_kwargs(selective: bool) -> dict[str, Any]:
    """Keyword arguments of the checkpoint function Transformers calls per layer.

    Non-reentrant checkpointing: gradients reach the adapters without the inputs requiring grad.
    """
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = selective_checkpoint_context
    return kwargs
