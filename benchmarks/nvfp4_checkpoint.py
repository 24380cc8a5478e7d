"""A benchmark shape's random-weight checkpoint in NVIDIA ModelOpt's NVFP4 layout, for the runner's NVFP4 rows.

Written without building the dense model (the shape's model is made on the meta device for its names and shapes):
every linear of the decoder layers and every expert's projection of an MoE shape (``<experts>.<e>.gate_proj``,
..., the per-expert linears ModelOpt writes; which projections make each bank is loralei's reading of
Transformers' conversion mapping) is stored as NVFP4: random e2m1 codes, block scales of 1 and a global scale
that gives the weight a standard deviation of 1/sqrt(in) (random codes have one of about 2.93). Everything else
(embeddings, norms, routers, the head) is dense random, as a freshly initialised model's. One safetensors file per
decoder layer, an index, the config with ModelOpt's quantization config, and a tokenizer covering the vocab.

    python benchmarks/nvfp4_checkpoint.py --shape qwen3-30b-a3b-8l --out /tmp/models/nvfp4-30b   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rows import build_model, vocab_tokenizer

from loralei.modules.lora_experts import experts_layout
from loralei.modules.quantized.unpack import E2M1_MAGNITUDES
from loralei.train import layered_load
from loralei.train.compile import decoder_layers
from loralei.train.quantized_banks import bank_projections

NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
_CODE_STD = math.sqrt(sum(v * v for v in E2M1_MAGNITUDES) / len(E2M1_MAGNITUDES))  # random e2m1 codes' std


def nvfp4_linear(out: int, inp: int, device: torch.device, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random NVFP4 tensors of an (out, in) linear (made on ``device``, returned on the CPU)."""
    codes = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, device=device, generator=g)
    return {
        "weight": codes.cpu(),
        "weight_scale": torch.ones(out, inp // 16, dtype=torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(inp**-0.5 / _CODE_STD),
        "input_scale": torch.tensor(1.0),
    }


def dense(shape: torch.Size, dtype: torch.dtype, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """A random dense parameter: ones for a norm's (1-D) weight, else normal with std 0.02."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, device=device, generator=g) * 0.02).to(dtype).cpu()


def layer_tensors(
    model: nn.Module, layer: nn.Module, prefix: str, device: torch.device, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors as ModelOpt stores them: its linears and experts' projections NVFP4, the rest
    dense."""
    projections = bank_projections(model)
    out, covered = {}, set()
    for name, module in layer.named_modules():
        full = f"{prefix}{name}" if name else prefix.rstrip(".")
        if type(module) is nn.Linear:
            parts = nvfp4_linear(module.out_features, module.in_features, device, g)
            out |= {f"{full}.{part}": t for part, t in parts.items()}
            covered.add(id(module.weight))
        elif (layout := experts_layout(module)) is not None:
            for bank in (layout.up, layout.down):
                param = getattr(module, bank)
                experts, rows, inp = param.shape
                for e in range(experts):
                    for proj in projections[bank]:
                        parts = nvfp4_linear(rows // len(projections[bank]), inp, device, g)
                        out |= {f"{full}.{e}.{proj}.{part}": t for part, t in parts.items()}
                covered.add(id(param))
    for name, param in layer.named_parameters():
        if id(param) not in covered:
            out[f"{prefix}{name}"] = dense(param.shape, param.dtype, device, g)
    return out


def save_nvfp4_checkpoint(shape: str, directory: Path, device: torch.device, dtype: torch.dtype) -> Path:
    """Writes the shape's random NVFP4 checkpoint into ``directory`` (the tokenizer last: a save cut short has
    none)."""
    model = build_model(shape, torch.device("meta"), dtype)
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    names_of = {id(m): name for name, m in model.named_modules()}
    prefixes = [f"{names_of[id(layer)]}." for layer in decoder_layers(model)]
    weight_map = {}
    for i, (layer, prefix) in enumerate(zip(decoder_layers(model), prefixes, strict=True)):
        file = f"layer-{i:05d}.safetensors"
        tensors = layer_tensors(model, layer, prefix, device, g)
        save_file(tensors, directory / file)
        weight_map |= dict.fromkeys(tensors, file)
    rest = {
        name: dense(p.shape, p.dtype, device, g)
        for name, p in model.named_parameters()
        if not name.startswith(tuple(prefixes))
    }
    save_file(rest, directory / "rest.safetensors")
    weight_map |= dict.fromkeys(rest, "rest.safetensors")
    (directory / layered_load.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text()) | {"quantization_config": NVFP4}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    vocab_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> Path:
    from bench_rows import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b-8l", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    return save_nvfp4_checkpoint(args.shape, args.out, device, dtype)


if __name__ == "__main__":
    main()
