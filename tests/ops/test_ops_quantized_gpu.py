"""GPU (bf16) numerics of the fused ops with quantized bases at real shapes: fused error vs an fp64 reference on
the dequantized weights <= 2x the plain bf16 error; and a bitsandbytes-loaded model trains fused == plain.

Run on a CUDA machine with ``pytest -m gpu tests/ops/test_ops_quantized_gpu.py``; CPU CI deselects these.
"""

from __future__ import annotations

import pytest
import torch

from loralei.modules.quantized.fp8 import FP8Weight, quantize_fp8
from loralei.modules.quantized.int4 import Int4Weight, quantize_int4
from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4
from loralei.ops import reference
from loralei.ops.lora_mlp import lora_mlp
from loralei.ops.lora_w import lora_w
from loralei.ops.shared_input import lora_group
from op_cases import as_dtype, outputs_and_grads, projection
from tolerances import assert_low_precision_close, rel_err

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
pytest.importorskip("torchao")


def _nf4_on_gpu(inp: int, out: int, seed: int, kernel: str, lora_dtype: torch.dtype):
    w = projection(inp, out, 16, bias=False, dtype=torch.bfloat16, lora_dtype=lora_dtype, seed=seed)
    quant = NF4Weight(quantize_nf4(w.W.to(CUDA), 64, 256), kernel)
    a, b = (t.detach().to(CUDA).requires_grad_() for t in (w.A, w.B))
    return w._replace(W=None, quant=quant, A=a, B=b)


def _int4_on_gpu(inp: int, out: int, seed: int, lora_dtype: torch.dtype = torch.bfloat16):
    w = projection(inp, out, 16, bias=False, dtype=torch.bfloat16, lora_dtype=lora_dtype, seed=seed)
    quant = Int4Weight(quantize_int4(w.W.to(CUDA), 128))
    a, b = (t.detach().to(CUDA).requires_grad_() for t in (w.A, w.B))
    return w._replace(W=None, quant=quant, A=a, B=b)


def _fp8_on_gpu(inp: int, out: int, seed: int, lora_dtype: torch.dtype = torch.bfloat16):
    w = projection(inp, out, 16, bias=False, dtype=torch.bfloat16, lora_dtype=lora_dtype, seed=seed)
    a, b = (t.detach().to(CUDA).requires_grad_() for t in (w.A, w.B))
    return w._replace(W=None, quant=FP8Weight(quantize_fp8(w.W.to(CUDA)), "auto"), A=a, B=b)


def _dense64(w):
    """The function the quantized projection computes, in fp64: its dequantized weight, dense."""
    return as_dtype(w._replace(W=w.quant.dequantize(), quant=None), torch.float64)


def _check(fused_fn, plain_fn, ws, x: torch.Tensor) -> None:
    params = [t for w in ws for t in (w.A, w.B)]
    w64 = [_dense64(w) for w in ws]
    exact = outputs_and_grads(lambda t: plain_fn(t, w64), x.double(), [t for w in w64 for t in (w.A, w.B)])
    fused = outputs_and_grads(lambda t: fused_fn(t, ws), x, params)
    plain = outputs_and_grads(lambda t: plain_fn(t, ws), x, params)
    for i, (f, p, e) in enumerate(zip(fused, plain, exact, strict=True)):
        assert_low_precision_close(f, p, e, torch.bfloat16, what=f"output/grad {i}")


@pytest.mark.parametrize("kernel", ["dequantize", "triton"])
@pytest.mark.parametrize("lora_dtype", [torch.bfloat16, torch.float32])
def test_lora_w_and_group_with_nf4_bases_bf16(kernel: str, lora_dtype: torch.dtype) -> None:
    x = torch.randn(2, 1024, 4096, device=CUDA, dtype=torch.bfloat16)
    o = _nf4_on_gpu(4096, 4096, 0, kernel, lora_dtype)
    _check(lambda t, ws: [lora_w(t, ws[0])], lambda t, ws: [reference.lora_linear(t, ws[0])], [o], x)
    qkv = [_nf4_on_gpu(4096, out, i, kernel, lora_dtype) for i, out in enumerate((4096, 1024, 1024))]
    _check(lambda t, ws: list(lora_group(t, ws)), lambda t, ws: list(reference.lora_group(t, ws)), qkv, x)


@pytest.mark.parametrize("kernel", ["dequantize", "triton"])
def test_lora_mlp_with_nf4_bases_bf16(kernel: str) -> None:
    gate, up = (_nf4_on_gpu(4096, 14336, s, kernel, torch.bfloat16) for s in (0, 1))
    down = _nf4_on_gpu(14336, 4096, 2, kernel, torch.bfloat16)
    x = torch.randn(1, 2048, 4096, device=CUDA, dtype=torch.bfloat16)
    _check(
        lambda t, ws: [lora_mlp(t, *ws, "silu")], lambda t, ws: [reference.lora_mlp(t, *ws, "silu")],
        [gate, up, down], x,
    )  # fmt: skip


def test_int4_products_equal_the_dequantized_weights_products() -> None:
    """tinygemm's X Wᵀ and the chunked dY W agree with dense products of the recovered weight."""
    w = projection(4096, 1024, 16, bias=False, dtype=torch.bfloat16).W.to(CUDA)
    q = Int4Weight(quantize_int4(w, 128))
    dense = q.dequantize()
    assert 0.05 < float((dense.double() - w.double()).norm() / w.double().norm()) < 0.15
    assert q.nbytes <= w.numel() // 2 + w.numel() // 128 * 4 + 1024
    x, dy = torch.randn(512, 4096, device=CUDA, dtype=torch.bfloat16), torch.randn(512, 1024, device=CUDA)
    dy = dy.to(torch.bfloat16)
    exact_y, exact_dx = x.double() @ dense.double().t(), dy.double() @ dense.double()
    assert_low_precision_close(q.mm(x), x @ dense.t(), exact_y, torch.bfloat16, "X Wᵀ")
    assert_low_precision_close(q.grad_mm(dy), dy @ dense, exact_dx, torch.bfloat16, "dY W")


def test_fused_ops_with_int4_bases_bf16() -> None:
    x = torch.randn(2, 512, 4096, device=CUDA, dtype=torch.bfloat16)
    qkv = [_int4_on_gpu(4096, out, i) for i, out in enumerate((4096, 1024, 1024))]
    _check(lambda t, ws: list(lora_group(t, ws)), lambda t, ws: list(reference.lora_group(t, ws)), qkv, x)
    gate, up = (_int4_on_gpu(4096, 14336, s) for s in (3, 4))
    down = _int4_on_gpu(14336, 4096, 5)
    _check(
        lambda t, ws: [lora_mlp(t, *ws, "silu")], lambda t, ws: [reference.lora_mlp(t, *ws, "silu")],
        [gate, up, down], x[:1],
    )  # fmt: skip


def _assert_trains_fused_like_plain(model: torch.nn.Module) -> None:
    """One step plain, one fused: the same loss and LoRA gradients (bf16: within 1 % and 5 %)."""
    from loralei import apply_fused_kernels
    from tiny_models import tiny_batch

    batch = {k: v.to(CUDA) for k, v in tiny_batch(seq=64).items()}
    plain = model(**batch).loss
    plain.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert not apply_fused_kernels(model).not_fused
    fused = model(**batch).loss
    fused.backward()
    assert abs(fused.item() - plain.item()) < 1e-2 * abs(plain.item())
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            err = (p.grad.float() - grads[name].float()).norm() / grads[name].float().norm()
            assert err < 5e-2, name


def test_int4_model_trains_fused_like_plain_and_unmerges_exactly() -> None:
    from loralei import LoRAConfig, inject_lora, merge_lora, unmerge_lora
    from loralei.inject import lora_modules
    from tiny_models import tiny_model

    model = tiny_model("llama", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512).to(CUDA)
    config = LoRAConfig(r=8, init_lora_weights=False, quantize_base=True, quantization_type="int4")
    inject_lora(model, config).train()
    assert all(type(m.quant).__name__ == "Int4Weight" for _, m in lora_modules(model))
    _assert_trains_fused_like_plain(model)
    packed = {n: m.weight for n, m in lora_modules(model)}
    merge_lora(model.eval())
    unmerge_lora(model)
    assert all(m.weight is packed[n] for n, m in lora_modules(model))


def test_bitsandbytes_model_trains_fused_like_plain_on_gpu(tmp_path) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from loralei import LoRAConfig, inject_lora
    from tiny_models import tiny_model

    tiny_model("llama", hidden_size=256, intermediate_size=512).save_pretrained(tmp_path)
    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4"
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, dtype=torch.bfloat16)
    inject_lora(model.to(CUDA), LoRAConfig(r=8, init_lora_weights=False)).train()
    _assert_trains_fused_like_plain(model)


@pytest.mark.parametrize("kind", ["nf4", "fp8"])
def test_compiled_ops_with_quantized_bases_match_eager(kind: str) -> None:
    """Inductor, fullgraph: the custom ops (quantized bases as handles, the backward an op of its own) give what
    the eager calls give, on the GPU kernels (NF4's fused matmul, FP8's GEMMs); the gated MLP, compiled as those
    ops, is as close to the fp64 result as the plain bf16 twin (NF4) or within 2^-6 of the eager op (FP8)."""
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    torch._dynamo.reset()
    make = (lambda i, o, s: _nf4_on_gpu(i, o, s, "triton", torch.bfloat16)) if kind == "nf4" else _fp8_on_gpu
    ws = [make(4096, out, seed) for seed, out in enumerate((4096, 1024, 1024))]
    x = torch.randn(2, 512, 4096, device=CUDA, dtype=torch.bfloat16)
    params = [t for w in ws for t in (w.A, w.B)]
    for fn in (lambda t: [lora_w(t, ws[0])], lambda t: list(lora_group(t, ws))):
        eager = outputs_and_grads(fn, x, params)
        compiled = outputs_and_grads(torch.compile(fn, fullgraph=True), x, params)
        for i, (c, e) in enumerate(zip(compiled, eager, strict=True)):
            torch.testing.assert_close(c, e, rtol=2**-8, atol=1e-5, msg=f"{kind} output/grad {i}")
    mlp = [make(4096, 2048, 3), make(4096, 2048, 4), make(2048, 4096, 5)]
    compiled_mlp = torch.compile(lambda t: lora_mlp(t, *mlp, "silu"), fullgraph=True)
    if kind == "nf4":
        _check(lambda t, ws: [compiled_mlp(t)], lambda t, ws: [reference.lora_mlp(t, *ws, "silu")], mlp, x)
        return
    # FP8 quantizes the activations, so no bf16 twin is as close: the compiled MLP (group op, activation, single
    # op) is held to the eager one (gated kernels), which rounds h once where the compiled graph rounds twice
    params = [t for w in mlp for t in (w.A, w.B)]
    eager = outputs_and_grads(lambda t: [lora_mlp(t, *mlp, "silu")], x, params)
    compiled = outputs_and_grads(lambda t: [compiled_mlp(t)], x, params)
    for i, (c, e) in enumerate(zip(compiled, eager, strict=True)):
        assert rel_err(c, e) <= 2**-6, f"fp8 MLP output/grad {i}: relative error {rel_err(c, e):.2e}"
