r"""Linear layer + cross entropy in chunks of rows: the loss of ``hidden @ Wᵀ`` without the full logits.

For each chunk of rows ``X_c``: ``L_c = X_c Wᵀ`` (the model's dtype, as its own head computes it), then one
kernel pass (:func:`loralei.kernels.cross_entropy.cross_entropy_rows_`) turns ``L_c`` into its per-row losses
and, in place, ``∂loss/∂L_c``; then ``dX_c = (∂loss/∂L_c) W`` (and ``dW += (∂loss/∂L_c)ᵀ X_c`` when the head
trains). The gradients are computed in the forward for a unit upstream gradient and scaled in the backward, so
no chunk's logits outlive it: peak extra memory is one chunk of logits plus dX.

Chunk rows come from a byte budget. Each chunk reads the whole head twice (its logits and its dX), so a chunk
must be tall enough for those GEMMs to be compute-bound (128-row chunks at a 150k vocabulary, hidden 2048, read
the 0.6 GB head 128 times for 8k rows: about 17 ms of memory traffic on an H200), and small enough that its
logits stay a fraction of the activations.

:func:`linear_token_losses` can also fill each row's ``log Σ_v p_v²`` (WPO's weights) from the same pass;
:func:`linear_mean_logits` gives each row's mean logit over the vocabulary (a logged metric) from the head's column
means, without forming logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import LoraleiError
from ..kernels.cross_entropy import cross_entropy_rows_

# logits of one chunk: 1024 rows at a 150k vocabulary in bf16 (297 MiB); an H200 ran 8,192 rows at hidden 2048
# through 128-row chunks (Liger's choice there) in 21 ms of GEMMs, through 1024-row chunks in 12 ms
CHUNK_BYTES = 320 * 2**20


def chunk_rows(vocab: int, itemsize: int, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk: the largest power of two whose logits fit in ``budget`` bytes (at least 1)."""
    rows = max(1, budget // (vocab * itemsize))
    return 1 << (rows.bit_length() - 1)


def _chunked_rows(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    softcap: float | None,
    rows: int,
    grads: tuple[Tensor | None, Tensor | None],
    sum_sq: Tensor | None = None,
) -> Tensor:
    """Each row's loss, chunk by chunk; fills ``grad_x`` (each row's ``∂loss_row/∂x_row``) and adds ``Σ ∂loss/∂W``
    into ``grad_w`` (either may be None), and fills ``sum_sq`` with each row's ``log Σ p²`` (when given)."""
    grad_x, grad_w = grads
    losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        x = hidden[start : start + rows]
        logits = x @ weight.t()
        squares = sum_sq[start : start + rows] if sum_sq is not None else None
        losses[start : start + rows] = cross_entropy_rows_(
            logits, targets[start : start + rows], ignore_index, softcap, squares
        )
        if grad_x is not None:
            torch.mm(logits, weight, out=grad_x[start : start + rows])
        if grad_w is not None:
            grad_w += logits.t() @ x
    return losses


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, softcap, rows: int):
        grad_x = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = _chunked_rows(hidden, weight, targets, ignore_index, softcap, rows, (grad_x, grad_w)).sum()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x * grad_loss.to(grad_x.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_loss).to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None


class _LinearTokenLosses(torch.autograd.Function):
    """Per-row losses: a row's loss depends on its own hidden state only, so ``dX`` is each row's unit gradient
    (from the forward) times that row's upstream gradient."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, softcap, rows: int, sum_sq
    ):
        grad_x = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        losses = _chunked_rows(hidden, weight, targets, ignore_index, softcap, rows, (grad_x, None), sum_sq)
        ctx.save_for_backward(grad_x)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        (grad_x,) = ctx.saved_tensors
        if grad_x is not None:
            grad_x = grad_x * grad_losses.unsqueeze(1).to(grad_x.dtype)
        return grad_x, None, None, None, None, None, None


def _check_shapes(hidden: Tensor, weight: Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise LoraleiError(
            f"linear_cross_entropy: hidden must be (rows, H) and weight (V, H); got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )


def _check(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, values: bool) -> None:
    _check_shapes(hidden, weight)
    if targets.shape != hidden.shape[:1]:
        raise LoraleiError(
            f"linear_cross_entropy: targets must be (rows,) = ({hidden.shape[0]},), got {tuple(targets.shape)}"
        )
    if not values:
        return
    bad = ((targets < 0) & (targets != ignore_index)) | (targets >= weight.shape[0])
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise LoraleiError(
            f"linear_cross_entropy: target {value} is outside the vocabulary [0, {weight.shape[0]}) and is not "
            f"the ignore index {ignore_index}; check the labels against the model's vocab_size"
        )


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    check_targets: bool = True,
) -> Tensor:
    """Summed cross entropy of ``hidden @ weightᵀ`` against ``targets``, never holding more than one chunk of
    logits; same value and gradients as the plain ``F.cross_entropy(hidden @ weight.T, ..., reduction="sum")``
    on logits in the weight's dtype (see ``reference.linear_cross_entropy``).

    Args:
        hidden: (rows, H), cast to the weight's dtype.
        weight: (V, H) output head; gets a gradient when it requires one.
        targets: (rows,) class of each row, or ``ignore_index``.
        ignore_index: the target of rows without loss.
        softcap: ``s`` of ``s·tanh(logits/s)`` (Gemma 2's final logit soft-capping), or ``None``.
        chunk_bytes: the logits budget of one chunk (see :func:`chunk_rows`).
        check_targets: check that every target is a class or ``ignore_index``. On a GPU the check reads a
            device value on the host (a sync, which a CUDA graph cannot capture): a caller that checked the
            targets already, as the runner does on the host, turns it off.

    Returns:
        The FP32 scalar sum over rows (divide by the token count for a mean).

    Raises:
        LoraleiError: shapes do not match, or (``check_targets``) a target is outside the vocabulary.
    """
    _check(hidden, weight, targets, ignore_index, check_targets)
    rows = chunk_rows(weight.shape[0], weight.element_size(), chunk_bytes)
    return _LinearCrossEntropy.apply(hidden.to(weight.dtype), weight, targets, ignore_index, softcap, rows)


def linear_token_losses(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    sum_sq: Tensor | None = None,
) -> Tensor:
    """Each row's cross entropy of ``hidden @ weightᵀ`` against ``targets`` (``-log p(target)``, 0 for ignored
    rows), one chunk of logits at a time: what a sequence's log-probability sums (preference objectives). Same
    values and hidden-state gradient as ``reference.linear_token_losses``.

    Args:
        hidden: (rows, H), cast to the weight's dtype; gets a gradient when it requires one.
        weight: (V, H) output head, frozen (a head that trains needs the summed loss, :func:`linear_cross_entropy`).
        targets: (rows,) class of each row, or ``ignore_index``; checked by the caller.
        ignore_index: the target of rows without loss.
        softcap: ``s`` of ``s·tanh(logits/s)``, or ``None``.
        chunk_bytes: the logits budget of one chunk (see :func:`chunk_rows`).
        sum_sq: (rows,) contiguous FP32, filled with each row's ``log Σ_v p_v²`` (no gradient), or None.

    Returns:
        (rows,) FP32 losses.

    Raises:
        LoraleiError: shapes do not match, or the head requires a gradient.
    """
    _check(hidden, weight, targets, ignore_index, False)
    if weight.requires_grad and torch.is_grad_enabled():
        raise LoraleiError(
            "linear_token_losses: the output head requires a gradient; per-row losses train a frozen head only "
            "(freeze it, or use linear_cross_entropy for a summed loss)"
        )
    rows = chunk_rows(weight.shape[0], weight.element_size(), chunk_bytes)
    return _LinearTokenLosses.apply(
        hidden.to(weight.dtype), weight, targets, ignore_index, softcap, rows, sum_sq
    )


@torch.no_grad()
def linear_mean_logits(
    hidden: Tensor, weight: Tensor, softcap: float | None = None, chunk_bytes: int = CHUNK_BYTES
) -> Tensor:
    """Each row's mean over the vocabulary of the logits ``hidden @ weightᵀ`` (soft-capped when ``softcap`` is
    set), without autograd: what TRL logs as ``logits/chosen`` / ``logits/rejected`` summed per token.

    Uncapped, the mean is linear: ``x · mean_v(W)``, one FP32 vector of the head's column means and a dot per
    row (no logits). Soft-capping is not linear, so a capped head's logits are formed chunk by chunk, as
    :func:`linear_cross_entropy` forms them (one more pass of the head's GEMM).

    Args:
        hidden: (rows, H), cast to the weight's dtype as the head's input is.
        weight: (V, H) output head.
        softcap: ``s`` of ``s·tanh(logits/s)``, or ``None``.
        chunk_bytes: the FP32 logits budget of one chunk (capped heads only).

    Returns:
        (rows,) FP32 means.

    Raises:
        LoraleiError: shapes do not match.
    """
    _check_shapes(hidden, weight)
    hidden = hidden.to(weight.dtype)
    means = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    rows = chunk_rows(weight.shape[0], 4, chunk_bytes)
    column_means = weight.sum(0, dtype=torch.float32) / weight.shape[0] if softcap is None else None
    for start in range(0, hidden.shape[0], rows):
        x = hidden[start : start + rows]
        if column_means is not None:
            means[start : start + rows] = x.float() @ column_means
        else:
            capped = (x @ weight.t()).float().div_(softcap).tanh_()
            means[start : start + rows] = capped.mean(1) * softcap
    return means
