"""DoRA down projections' outputs kept from a checkpointed layer's forward for its recomputation, in host memory.

A DoRA projection's magnitude gradient reads its output (``dm = Σ_t dY ⊙ Z / ‖W + s B A‖``,
:mod:`loralei.ops.dora`). A checkpoint's recomputation of a LoRA layer leaves the MLP's down product unformed
(nobody reads it: :mod:`loralei.ops.recompute`); with DoRA on down it forms it again for dm: one more
hidden × intermediate GEMM a layer, the largest part of what DoRA costs over LoRA under checkpointing (+42 ms of
a 684 ms step at the Llama-3-8B shape and 8,192 tokens on an H100). Kept on the device, the outputs would hold
tokens × hidden values a layer through the step (2 GiB there). So each layer's forward sends its DoRA down output to
a pinned host buffer on a side stream, and it comes back one layer ahead of its recomputation, as offloaded layer
inputs do (:mod:`.input_checkpoint`): a copy each way (about 1.3 ms for those 64 MB at PCIe 5's rate) beside about
19 ms of a layer's compute. The recomputation's fused MLP takes it (:func:`loralei.ops.lora_mlp.lora_mlp`'s
``kept_down``) and forms only what its backward reads; the backward is the same, so are the gradients, bit for bit.

The layer's keeper is the :class:`~.kept_attention.LayerAttention` of offloaded checkpointing (which keeps
attention results and q/k/v/o outputs for long rows), here keeping outputs only, with ``gradient_checkpointing:
true`` too. What the outputs may take of the host is :func:`~.kept_attention.host_budget` less the offloaded
layer inputs; layers past it form the product again.

Without checkpointing, the DoRA outputs go to host memory for the backward instead (:mod:`.dora_stash`).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from ..fusion import mlp as fused_mlp
from ..fusion.specs import spec_for
from ..modules.lora_linear import LoRALinear
from .kept_attention import HOST_SHARE, PassKeeping, host_budget
from .pinned import tensor_held_bytes


def owners(model: nn.Module) -> frozenset[int]:
    """Ids of ``model``'s MLP down projections (by its family's name) that have DoRA and run in the fused MLP
    (installed, no dropout): the ones that ask their layer's keeper for their outputs."""
    down = spec_for(model).down
    return frozenset(
        id(module)
        for name, module in model.named_modules()
        if down is not None
        and name.rpartition(".")[2] == down
        and isinstance(module, LoRALinear)
        and module.lora_magnitude_vector is not None
        and not module.dropout_p
        and fused_mlp.is_installed(model.get_submodule(name.rpartition(".")[0]))
    )


class OutputBudget(NamedTuple):
    """What a pass of ``layers`` checkpointed layers may keep of the outputs of projections ``owners`` (ids)."""

    owners: frozenset[int]
    layers: int

    def plan(self, hidden: Tensor, offload: bool) -> PassKeeping:
        """The host budget left for the outputs once the pass's offloaded inputs (each like its first,
        ``hidden``) are counted; no attention results."""
        inputs = tensor_held_bytes(hidden) if offload else 0
        return PassKeeping(max(host_budget() - self.layers * inputs, 0))


def note(kept: frozenset[int]) -> str:
    """The run's report line for keeping these DoRA down projections' outputs."""
    return (
        f"DoRA: the outputs of its {len(kept)} down projections kept in pinned host memory from each layer's "
        f"forward for its recomputation (their magnitudes' gradients read them), as far as {HOST_SHARE:.0%} of "
        "the host's memory goes: those products are not formed again"
    )
