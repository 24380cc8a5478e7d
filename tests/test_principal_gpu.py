"""PiSSA / OLoRA on CUDA: the decomposition on the GPU, a bf16 base packed as NF4 on the packing device, the
fused ops on the residual base, and the native round trip."""

from __future__ import annotations

import pytest
import torch

from loralei import LoRAConfig, apply_fused_kernels, inject_lora, load_pretrained, save_pretrained
from loralei.inject import lora_modules
from loralei.modules.principal_init import initial_factors
from loralei.modules.quantized.nf4 import NF4Weight, quantize_nf4
from tiny_models import tiny_batch, tiny_model

pytestmark = pytest.mark.gpu
SMALL_BLOCKS = {"nf4_block_size": 16, "nf4_scaler_block_size": 2}


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_a_bf16_nf4_residual_base_trains_fused_and_reloads_exactly(tmp_path, init) -> None:
    pytest.importorskip("torchao")
    config = LoRAConfig(
        r=4, init_lora_weights=init, quantize_base=True, quantization_device="cuda", **SMALL_BLOCKS
    )
    model = tiny_model(dtype=torch.bfloat16)  # on the CPU: decomposed and packed on the GPU
    original = {
        n: m.weight.detach().float().cuda() for n, m in model.named_modules() if type(m) is torch.nn.Linear
    }
    inject_lora(model, config)
    model.cuda()
    for name, module in lora_modules(model):
        a0, b0 = initial_factors(module)
        assert module.weight.is_cuda and a0.is_cuda and a0.dtype == torch.bfloat16
        principal = module.scale * b0.float() @ a0.float()
        packed = module.quant.dequantize().float()
        # the residual, packed: NF4 of W - s B0 A0 (a code may flip where the GPU rounds the residual differently)
        again = NF4Weight(quantize_nf4((original[name] - principal).bfloat16(), 16, 2)).dequantize().float()
        assert (packed - again).norm() < 1e-2 * again.norm(), name
        if init != "olora":  # PiSSA's point: the residual packs with less error than the whole weight
            plain = NF4Weight(quantize_nf4(original[name].bfloat16(), 16, 2)).dequantize().float()
            assert (packed + principal - original[name]).norm() < (plain - original[name]).norm(), name
    apply_fused_kernels(model)
    batch = {k: v.cuda() for k, v in tiny_batch().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    for _ in range(2):
        loss = model(**batch).loss
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    save_pretrained(model, tmp_path / "a")
    fresh = load_pretrained(
        tiny_model(dtype=torch.bfloat16), tmp_path / "a", quantization_device="cuda"
    ).cuda()
    apply_fused_kernels(
        fresh
    )  # the same kernels as the trained model: fused and plain forwards round differently
    with torch.no_grad():
        assert torch.equal(fresh(**batch).logits, model(**batch).logits)
