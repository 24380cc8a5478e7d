"""DoRA's in-place column scaling kernel vs torch's ``y.mul_(g)`` (then ``.add_(bias)``), bit for bit (Triton
interpreter, fp32 and fp16): odd shapes, strided rows, biases in the tensor's dtype and in FP32; and the DoRA op,
group and MLP down launching it with the same outputs and gradients as the torch passes, and a tiny DoRA Llama's
loss and gradients, with and without checkpointing."""

from __future__ import annotations

import pytest
import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora
from loralei.kernels import column_scale
from loralei.ops import lora_mlp, shared_input
from loralei.ops.dora import DoRAScale, dora_w, row_norms, squared_row_norms
from loralei.train.checkpointing import enable_checkpointing
from op_cases import outputs_and_grads, projection
from tiny_models import perturb_magnitudes, tiny_batch, tiny_model

SHAPES = [(37, 45), (5, 70), (64, 32), (1, 1)]


def _inputs(tokens: int, n_out: int, dtype: torch.dtype):
    """``Z`` as a column slice of a wider buffer (row stride > N), FP32 ``g`` with values whose products round."""
    gen = torch.Generator().manual_seed(tokens * n_out)
    z = (3 * torch.randn(tokens, n_out + 5, generator=gen)).to(dtype)[:, 2 : 2 + n_out]
    g = 1 + 0.3 * torch.randn(n_out, generator=gen)
    return z, g, torch.randn(n_out, generator=gen)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(("tokens", "n_out"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [None, "same", "fp32"])
def test_kernel_is_torch_bit_for_bit(tokens: int, n_out: int, dtype: torch.dtype, bias: str | None) -> None:
    z, g, b = _inputs(tokens, n_out, dtype)
    b = None if bias is None else b.to(dtype if bias == "same" else torch.float32)
    want = z.clone().mul_(g)
    if b is not None:
        want.add_(b)
    formula = (z.float() * g).to(dtype)  # what torch computes: rounded once, then the bias in FP32, rounded
    formula = formula if b is None else (formula.float() + b.float()).to(dtype)
    assert torch.equal(want, formula)
    assert column_scale.usable(z, g, b)
    out = column_scale.scale_columns_(z, g, b)
    assert out is z and out.dtype == dtype
    assert torch.equal(z, want)


def test_not_usable_where_torch_keeps_the_passes(interpret) -> None:
    z, g, b = _inputs(8, 6, torch.float32)
    assert not column_scale.usable(z.t(), g[:8], None)  # strided columns
    assert not column_scale.usable(z, g.double(), None)
    assert not column_scale.usable(z, g[:5], None)
    assert not column_scale.usable(z, g, b.double())
    assert not column_scale.usable(z.double(), g, None)
    assert not column_scale.usable(z.reshape(2, 4, 6), g, None)


def _launches(monkeypatch) -> list:
    """Counts the kernel's launches."""
    launched = []
    original = column_scale.scale_columns_
    monkeypatch.setattr(column_scale, "scale_columns_", lambda *a: launched.append(1) or original(*a))
    return launched


def _torch_only(monkeypatch) -> None:
    monkeypatch.setattr(column_scale, "usable", lambda *a: False)


def _magnitude(w) -> torch.Tensor:
    """A magnitude away from the row norms (g ≠ 1), in the base's dtype."""
    norms = row_norms(w, squared_row_norms(w))
    noise = torch.randn(norms.shape, generator=torch.Generator().manual_seed(norms.numel()))
    return (norms * (1 + 0.2 * noise)).to(w.W.dtype).requires_grad_()


def _same_with_and_without_kernel(monkeypatch, run, launches: int) -> None:
    launched = _launches(monkeypatch)
    with_kernel = run()
    assert len(launched) == launches
    _torch_only(monkeypatch)
    for f, t in zip(with_kernel, run(), strict=True):
        assert torch.equal(f, t)


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("node", ["single", "group"])
def test_dora_op_and_group_scale_with_the_kernel(
    monkeypatch, dtype: torch.dtype, bias: bool, node: str
) -> None:
    ws = [projection(24, out, 4, bias, dtype=dtype, seed=i) for i, out in enumerate((40, 16, 16))]
    ms = [_magnitude(w) for w in ws]
    x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    params = [p for w, m in zip(ws, ms, strict=True) for p in (w.A, w.B, m)]

    def single():
        return outputs_and_grads(lambda t: [dora_w(t, ws[0], ms[0], squared_row_norms(ws[0]))], x, params[:3])

    def group():
        def fwd(t):
            scales = [DoRAScale(m, row_norms(w, squared_row_norms(w))) for w, m in zip(ws, ms, strict=True)]
            return list(shared_input.lora_group(t, ws, scales=[scales[0], None, scales[2]]))

        return outputs_and_grads(fwd, x, params)

    _same_with_and_without_kernel(
        monkeypatch, single if node == "single" else group, 1 if node == "single" else 2
    )


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_down_scales_with_the_kernel(monkeypatch, bias: bool) -> None:
    sizes = ((16, 24), (16, 24), (24, 16))
    gate, up, down = (projection(i, o, 4, bias, seed=k) for k, (i, o) in enumerate(sizes))
    m_d = _magnitude(down)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))

    def run():
        def fwd(t):
            sc = DoRAScale(m_d, row_norms(down, squared_row_norms(down)))
            return [lora_mlp.lora_mlp(t, gate, up, down, "silu", scales=(None, None, sc))]

        return outputs_and_grads(fwd, x, [gate.A, gate.B, up.A, up.B, down.A, down.B, m_d])

    _same_with_and_without_kernel(monkeypatch, run, 1)


def _model_loss_and_grads(checkpointing: bool) -> list[torch.Tensor]:
    """The loss and every trainable gradient of a tiny DoRA Llama with biases on the fused path."""
    model = inject_lora(
        tiny_model(attention_bias=True, mlp_bias=True),
        LoRAConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False),
    )
    apply_fused_kernels(perturb_magnitudes(model))
    if checkpointing:
        enable_checkpointing(model, compiled=False, offload=False)
    model.train()
    out = model(**tiny_batch())
    out.loss.backward()
    return [out.loss.detach(), *(p.grad for p in model.parameters() if p.requires_grad)]


@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiny_llama_with_the_kernel_equals_torch_passes(monkeypatch, checkpointing: bool) -> None:
    """A tiny Llama's loss and every gradient bit for bit with the kernel (five scalings a layer; four again in a
    recomputation, which takes down's output kept from the forward: loralei.train.kept_dora) and with torch's
    passes."""
    launches = 5 * 2 + (4 * 2 if checkpointing else 0)
    _same_with_and_without_kernel(monkeypatch, lambda: _model_loss_and_grads(checkpointing), launches)
