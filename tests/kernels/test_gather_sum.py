"""The gather-sum kernel (Triton interpreter, fp32 and fp16) and its torch twin against torch's own backward of a row
gather (``index_select``'s, which adds into zeros), bit for bit: one and two places a row, places < 0 reading
zeros, odd widths and row counts; and the shared-prompt attention's gathers taking it in their backward with the
gradients ``index_select`` gives."""

from __future__ import annotations

import pytest
import torch

from loralei.kernels import gather_sum as gs
from loralei.train import shared_prompt

SHAPES = [(7, 5, 3), (40, 33, 70), (1, 1, 1), (64, 100, 17)]  # (source rows, gathered rows, columns)


def _reads(sources: int, gathered: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gather ``index`` (each source row read at most twice, some not at all) and the ``(sources, 2)`` places
    that read each source row, -1 for none."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(2 * sources, generator=gen)[:gathered] % sources  # each row at most twice
    index = slots[torch.randperm(gathered, generator=gen)]
    places = torch.full((sources, 2), -1, dtype=torch.long)
    for place, row in enumerate(index.tolist()):
        places[row, int(places[row, 0] >= 0)] = place
    return index, places


def _index_select_grad(grad: torch.Tensor, index: torch.Tensor, sources: int) -> torch.Tensor:
    """What ``index_select``'s backward gives: ``grad``'s rows added into zeros at ``index``."""
    return grad.new_zeros(sources, grad.shape[1]).index_add_(0, index, grad)


def _grads(gathered: int, columns: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (3 * torch.randn(gathered, columns + 4, generator=gen)).to(dtype)[:, 2 : 2 + columns]


@pytest.mark.parametrize(("sources", "gathered", "columns"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_torch_twin_is_index_selects_backward(sources, gathered, columns, dtype) -> None:
    index, places = _reads(sources, min(gathered, 2 * sources), sources * columns)
    grad = _grads(len(index), columns, dtype, sources)
    want = _index_select_grad(grad, index, sources)
    assert torch.equal(gs._torch_gather_sum(grad.contiguous(), places[:, 0], places[:, 1]), want)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(("sources", "gathered", "columns"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_kernel_is_index_selects_backward(sources, gathered, columns, dtype, monkeypatch) -> None:
    monkeypatch.setattr(gs, "_torch_gather_sum", None)  # the kernel must serve
    index, places = _reads(sources, min(gathered, 2 * sources), sources * columns)
    grad = _grads(len(index), columns, dtype, sources)
    want = _index_select_grad(grad, index, sources)
    assert torch.equal(gs.gather_sum(grad, places[:, 0], places[:, 1]), want)
    once = places[:, 0].clone()
    once[places[:, 1] >= 0] = -1  # rows read once: a copy, the others zeros
    got = gs.gather_sum(grad, once)
    kept = once >= 0
    assert torch.equal(got[kept], grad.contiguous()[once[kept]]) and not got[~kept].any()


def test_bf16_takes_the_torch_twin_in_the_interpreter(monkeypatch) -> None:
    """The interpreter has no bf16: the twin serves it (the GPU compiles the kernel for bf16)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    index, places = _reads(9, 12, 0)
    grad = _grads(12, 8, torch.bfloat16, 0)
    assert torch.equal(gs.gather_sum(grad, places[:, 0], places[:, 1]), _index_select_grad(grad, index, 9))


@pytest.mark.parametrize("interpreted", [False, True])
def test_the_attention_gathers_backward_is_index_selects(interpreted: bool, monkeypatch) -> None:
    """``shared_prompt._Gather``: the forward is ``index_select``'s, the backward its gradient (through the kernel
    in the interpreter), for states of the attention's (rows, heads, dim) shape."""
    if interpreted:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(gs, "_torch_gather_sum", None)
    index, places = _reads(30, 45, 3)
    states = torch.randn(30, 4, 8, requires_grad=True)
    want_states = states.detach().clone().requires_grad_()
    got = shared_prompt._Gather.apply(states, index, places)
    want = want_states.index_select(0, index)
    assert torch.equal(got, want)
    grad = torch.randn_like(want)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(states.grad, want_states.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_on_the_gpu_the_kernel_is_index_selects_backward(dtype: torch.dtype) -> None:
    """The compiled kernel, bf16 included, at a query's width (32 heads of 128)."""
    index, places = _reads(3000, 5000, 7)
    grad = _grads(5000, 4096, dtype, 7).cuda()
    index, places = index.cuda(), places.cuda()
    want = _index_select_grad(grad, index, 3000)
    assert torch.equal(gs.gather_sum(grad, places[:, 0], places[:, 1]), want)
