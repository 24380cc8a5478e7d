"""Shared-input groups at run time: the first member called computes every member's output in one op.

How a cached output can never be stale: outputs are held only for the exact input tensor object they were
computed from, and handed out at most once each. A member gets a held output only when it is called with that
same tensor, at the same version counter (no in-place change since), in the same grad mode, with its own
weights unchanged (same version counters, same train/eval mode). Anything else computes afresh: another input,
a repeated call, a member called twice. Gradient checkpointing recomputes the layer, so the group simply runs
again on the recomputed input. Memory: held outputs live between the members' calls, which are back to back in
every attention and MLP (q, k, v); the input reference is dropped when the last held output is handed out; at
most one set per group stays held if a model skips a member, until the group's next call or ``clear``.

Under ``torch.compile`` the same sharing is traced: the group's custom op runs once in the compiled graph and
the other members take their outputs from it. The tracer follows the identity test but cannot read version
counters, so there the states compare empty: within one compiled frame (a decoder layer) nothing changes the
input or the weights between the members' back-to-back calls, and the frame ends holding nothing once every
member has taken its output.

The members' dense frozen base weights are moved into one buffer when the group forms (:func:`stack_bases`: same
values, each weight a row block of it), so that the group's backward can take ``Σ dY_i W_i`` as one GEMM where
the output gradients lie side by side too (:mod:`loralei.kernels.joint_buffer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels.joint_buffer import joined
from ..modules.dora import fused_scale
from ..modules.lora_linear import LoRALinear
from ..ops import kept_outputs
from ..ops.shared_input import lora_group


def _stackable(members: Sequence[LoRALinear]) -> bool:
    weights = [m.weight for m in members]
    first = weights[0]
    return all(
        m.quant is None
        and type(w.data) is torch.Tensor  # a plain tensor (not a quantized or sharded subclass)
        and not w.is_meta
        and not w.requires_grad
        and w.dim() == 2
        and w.is_contiguous()
        and (w.dtype, w.device, w.shape[1]) == (first.dtype, first.device, first.shape[1])
        for m, w in zip(members, weights, strict=True)
    )


def stack_bases(members: Sequence[LoRALinear]) -> None:
    """Moves the members' base weights into one buffer, in member order, each a row block of it (the same
    values; each module keeps its own ``Parameter``).

    Only dense, frozen, contiguous 2-D weights of one dtype, device and input size move; a group whose weights
    already lie so is left as it is.
    """
    if not _stackable(members):
        return
    weights = [m.weight for m in members]
    run = weights[0].detach()
    for w in weights[1:]:
        run = joined(run, w.detach(), 0) if run is not None else None
    if run is not None:
        return
    stacked = torch.cat([w.detach() for w in weights])
    for w, block in zip(weights, stacked.split([w.shape[0] for w in weights]), strict=True):
        w.data = block


def _weights_state(member: LoRALinear) -> tuple:
    if torch.compiler.is_compiling():  # the tracer reads no version counters (module docstring)
        return ()
    return (
        member.weight._version,
        member.lora_A.weight._version,
        member.lora_B.weight._version,
        -1 if member.lora_magnitude_vector is None else member.lora_magnitude_vector._version,
        member.training,
    )


def _input_state(x: torch.Tensor) -> tuple:
    if torch.compiler.is_compiling():  # likewise
        return ()
    version = -1 if x.is_inference() else x._version  # inference tensors have no version counter
    return (version, torch.is_grad_enabled())


class SharedInputGroup:
    """N LoRA projections that their parent calls on one input tensor (q/k/v, gate/up).

    Attributes:
        name: a readable name, e.g. ``model.layers.0.self_attn.{q_proj,k_proj,v_proj}``.
        members: the projections, in the order their dropout masks are drawn.
    """

    def __init__(self, name: str, members: Sequence[LoRALinear]) -> None:
        self.name = name
        self.members = tuple(members)
        self._index = {id(m): i for i, m in enumerate(self.members)}
        self._held: dict[int, tuple[torch.Tensor, tuple]] = {}
        self._input: torch.Tensor | None = None
        self._input_key: tuple = ()

    def clear(self) -> None:
        """Drops held outputs and the input reference."""
        self._held = {}
        self._input = None
        self._input_key = ()

    def output_for(self, member: LoRALinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for ``x``: a held one, or all members' outputs computed now.

        Returns:
            The output, or ``None`` when the group cannot run (a member merged, disabled or with a trainable
            base); the member then computes its own output.
        """
        i = self._index[id(member)]
        held = self._take(i, x)
        if held is not None:
            return held
        if not all(m.can_run_fused() for m in self.members):
            return None
        self.clear()
        ws = [m.lora_weights() for m in self.members]
        scales = None
        if any(m.lora_magnitude_vector is not None for m in self.members):  # DoRA members
            scales = [fused_scale(m, w) for m, w in zip(self.members, ws, strict=True)]
        if scales is None:  # LoRA members: a checkpoint's recomputation may have their outputs kept
            outs = kept_outputs.run(
                self.members, lambda: lora_group(x, ws), lambda kept: lora_group(x, ws, kept=kept)
            )
        else:
            outs = lora_group(x, ws, scales=scales)
        pairs = enumerate(zip(self.members, outs, strict=True))
        self._held = {j: (out, _weights_state(m)) for j, (m, out) in pairs if j != i}
        if self._held:
            self._input, self._input_key = x, _input_state(x)
        return outs[i]

    def _take(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        if self._input is not x or i not in self._held:
            return None
        out, weights_state = self._held.pop(i)
        fresh = self._input_key == _input_state(x) and weights_state == _weights_state(self.members[i])
        if not self._held:
            self.clear()
        return out if fresh else None
