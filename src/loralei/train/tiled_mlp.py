"""``training.tiled_mlp``: each decoder layer's MLP runs over the sequence in tiles, so its intermediates (the
gate, up and activation outputs: 3 × 14,336 values a token at Llama-3-8B, more than three times the hidden
states) exist for one tile at a time, in the forward, a checkpoint's recomputation and the backward.

The MLP is one autograd node (:class:`_TiledMLP`) that keeps only its input. Its forward runs the MLP tile by
tile without autograd; its backward runs each tile again with autograd and takes the tile's input gradient and
the MLP's parameter gradients from it, summed over the tiles (in FP32 for lower-precision parameters). The MLP
forward would thus run once more per step, the price of never holding a full-length intermediate, but under
checkpointing the layer's forward already runs again in the backward, and in that recomputation the node
leaves its output unfilled unless a later op could read it (:mod:`loralei.ops.recompute`; in a Llama-style
layer none does): the MLP runs as often as untiled (at 32K tokens on an H200 the 8B step went from 5.4 to 4.7
s; benchmarks/results/archive/2026-12-04-h200-profile-runner-32k-*.json). The backward's run of a tile is such
a recomputation too: only its graph is wanted, not its output, so the MLP's last op (the fused MLP's down
projection, the experts' down bank and combine) leaves that output unfilled there as well: a third of a gated
MLP's forward FLOPs, an estimated 4 % of the 8B step at 32K tokens. Where a later op of the MLP saved tensors
after it (it may have read the unfilled output), the tile runs again in full, and that MLP's later tiles run
in full from the start. Rows no longer than one tile run the MLP as it is. The MLP's own forward is whatever
it was (the fused gated LoRA op, an MoE block, the class forward), so the tiles compute exactly what the whole
sequence would, row for row: the same loss, and gradients equal up to the order of the tiles' sums.

Tiles are ``hidden_size`` tokens long (as in Arctic Long Sequence Training: a tile's intermediates then take
about as much memory as the layer's full-length hidden states). ``auto`` tiles when rows may be at least
:data:`AUTO_TOKENS` long. Dropout on the MLP's LoRA would draw other masks in the backward's second run: such
runs, and ``torch_compile``, are refused with ``true`` and left untiled by ``auto``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..errors import LoraleiError
from ..ops import recompute

AUTO_TOKENS = 32768
# the decoder layer's child that holds its MLP (or MoE block), by family; data, not code
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")
MIN_TILE = 256


def tile_tokens(model: nn.Module) -> int:
    """Tokens per tile: the model's hidden size (at least :data:`MIN_TILE`)."""
    config = getattr(model, "config", None)
    hidden = getattr(getattr(config, "get_text_config", lambda: config)(), "hidden_size", None)
    return max(int(hidden or MIN_TILE), MIN_TILE)


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP (the first child named as in :data:`MLP_NAMES` of a ``*DecoderLayer``)."""
    found = []
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            child = next(
                (getattr(module, n) for n in MLP_NAMES if isinstance(getattr(module, n, None), nn.Module)),
                None,
            )
            if child is not None:
                found.append(child)
    return found


def install(model: nn.Module, tokens: int) -> int:
    """Makes every decoder layer's MLP run in tiles of ``tokens`` (an instance-attribute ``forward`` around the
    one it had); returns how many MLPs were tiled."""
    mlps = mlp_modules(model)
    for mlp in mlps:
        inner = vars(mlp).get("forward") or type(mlp).forward.__get__(mlp)
        mlp.forward = functools.partial(tiled_forward, mlp, inner, tokens)
    return len(mlps)


def tiles(length: int, tokens: int) -> list[slice]:
    return [slice(start, min(start + tokens, length)) for start in range(0, length, tokens)]


def tiled_forward(mlp: nn.Module, forward: Callable, tokens: int, x: torch.Tensor) -> torch.Tensor:
    """``forward(x)``, tile by tile along the sequence (dimension -2) when ``x`` is longer than one tile."""
    if x.dim() < 2 or x.shape[-2] <= tokens:
        return forward(x)
    spans = tiles(x.shape[-2], tokens)
    if not torch.is_grad_enabled():
        return _run_tiles(forward, spans, x)
    params = [p for p in mlp.parameters() if p.requires_grad]
    defer = recompute.may_defer()
    y = _TiledMLP.apply(mlp, forward, spans, defer, x, *params)
    if defer:
        recompute.settle()
    return y


def _tile(t: torch.Tensor, span: slice) -> torch.Tensor:
    return t[..., span, :].contiguous()


def _run_tiles(forward: Callable, spans: Sequence[slice], x: torch.Tensor) -> torch.Tensor:
    """The MLP's output, one tile at a time, outside any checkpoint recomputation (whose ops may leave an unread
    output unfilled: each tile's output is read here)."""
    out = None
    previous, recompute.Recomputation.current = recompute.Recomputation.current, None
    try:
        for span in spans:
            y = forward(_tile(x, span))
            if not isinstance(y, torch.Tensor):
                raise LoraleiError(
                    f"training.tiled_mlp: the MLP returns {type(y).__name__}, not one tensor, so it cannot run in "
                    "tiles; set training.tiled_mlp: false"
                )
            if out is None:
                out = y.new_empty(*x.shape[:-1], y.shape[-1])
            out[..., span, :] = y
    finally:
        recompute.Recomputation.current = previous
    return out


# MLPs whose tiles, run again in a backward, had an op save tensors after the op that left its output
# unfilled: their tiles run in full there
_READ_AFTER: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _tile_graph(mlp: nn.Module, forward: Callable, xt: torch.Tensor) -> torch.Tensor:
    """The MLP's forward over one tile with autograd, for its gradients only (the module docstring says how
    its output may stay unfilled, and when the tile runs again in full)."""
    with torch.enable_grad():
        if mlp in _READ_AFTER:
            return forward(xt)
        yt, read_after = recompute.watched(lambda: forward(xt))
        if not read_after:
            return yt
        _READ_AFTER.add(mlp)
        return forward(xt)


class _TiledMLP(torch.autograd.Function):
    """The MLP over the tiles of its input; keeps only the input (see the module docstring). ``defer``: a
    checkpoint recomputation whose output may stay unfilled (:func:`loralei.ops.recompute.defer`)."""

    @staticmethod
    def forward(
        ctx,
        mlp: nn.Module,
        forward: Callable,
        spans: list[slice],
        defer: bool,
        x: torch.Tensor,
        *params: torch.Tensor,
    ):
        ctx.mlp, ctx.forward, ctx.spans = mlp, forward, spans
        ctx.save_for_backward(x, *params)
        if not defer:
            return _run_tiles(forward, spans, x)
        # the MLP maps the hidden states to their own width (the residual adds them)
        out = x.new_empty(x.shape)
        recompute.defer(out, functools.partial(_run_tiles, forward, spans, x))
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *params = ctx.saved_tensors
        input_grad = ctx.needs_input_grad[4]
        dx = torch.empty_like(x) if input_grad else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for span in ctx.spans:
            xt = _tile(x, span).detach().requires_grad_(input_grad)
            yt = _tile_graph(ctx.mlp, ctx.forward, xt)
            wanted = [xt] if input_grad else []
            grads = torch.autograd.grad(yt, [*wanted, *params], _tile(dy, span), allow_unused=True)
            if input_grad:
                dx[..., span, :] = grads[0]
            for i, g in enumerate(grads[len(wanted) :]):
                if g is not None:
                    g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                    sums[i] = g if sums[i] is None else sums[i].add_(g)
        param_grads = [s if s is None else s.to(p.dtype) for s, p in zip(sums, params, strict=True)]
        return None, None, None, None, dx, *param_grads
