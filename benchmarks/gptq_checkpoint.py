"""A GPTQ copy of a saved bf16 checkpoint, for benchmarks that load a GPTQ model as its users do.

Every decoder-layer linear's weight is quantized round-to-nearest (4 bits, asymmetric, one fp16 scale and zero
point per ``group_size`` inputs; act-order optional, with a random ``g_idx``) and written in GPTQ's v1 layout
(``qweight`` int32 (in/8, out), eight rows per word; ``qzeros`` int32 (groups, out/8), stored as zero - 1;
``scales`` fp16 (groups, out); ``g_idx`` int32 (in,)). Embeddings, norms and the head stay as saved. The codes come
from the saved weights, so the model computes about what the bf16 one does (RTN, not GPTQ's error feedback: the
layout and the work per step are the same).

    python benchmarks/gptq_checkpoint.py /tmp/bench-ckpt-llama3-8b /tmp/bench-ckpt-llama3-8b-gptq
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"model\.layers\.\d+\..*_proj\.weight")
SHIFTS = torch.arange(0, 32, 4)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """(..., 8) 4-bit values, slot k at bits 4k, as int32 words (two's complement)."""
    words = (nibbles.long() << SHIFTS.to(nibbles.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize(weight: torch.Tensor, group_size: int, act_order: bool) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of one (out, in) weight, quantized round-to-nearest on its device."""
    out, inp = weight.shape
    g_idx = torch.arange(inp, device=weight.device) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(inp, device=weight.device)]
    w = weight.float().t()  # (in, out): GPTQ's orientation
    groups = inp // group_size
    order = torch.argsort(g_idx, stable=True)  # the inputs of group g are rows order[g*gs:(g+1)*gs]
    grouped = w[order].reshape(groups, group_size, out)
    low, high = grouped.amin(1).clamp(max=0), grouped.amax(1).clamp(min=0)
    # 14 steps span the range: v1 stores zero - 1, so a zero point of 0 (which would wrap) is moved up to 1
    scale = ((high - low) / 14).clamp(min=1e-8).half()
    zero = (-low / scale.float()).round().clamp(1, 15)
    codes = (w / scale.float()[g_idx] + zero[g_idx]).round().clamp(0, 15).long()
    return {
        "qweight": _words(codes.reshape(inp // 8, 8, out).transpose(1, 2)),
        "qzeros": _words((zero.long() - 1).reshape(groups, out // 8, 8)),
        "scales": scale,
        "g_idx": g_idx.to(torch.int32),
    }


def convert(source: Path, target: Path, group_size: int = 128, act_order: bool = False) -> Path:
    """Writes ``source``'s GPTQ copy into ``target`` (kept when it already holds one: the tokenizer is written
    last) and returns ``target``."""
    if (target / "tokenizer.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    index = source / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    for shard in sorted(source.glob("*.safetensors")):
        state = load_file(shard)
        for name in [n for n in state if LINEAR.fullmatch(n)]:
            parts = quantize(state.pop(name).to(device), group_size, act_order)
            prefix = name.removesuffix(".weight")
            state |= {f"{prefix}.{part}": t.cpu() for part, t in parts.items()}
            if weight_map is not None:
                del weight_map[name]
                weight_map |= {f"{prefix}.{part}": shard.name for part in parts}
        save_file(state, target / shard.name, metadata={"format": "pt"})
    if weight_map is not None:
        (target / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": False,
        "checkpoint_format": "gptq",
    }  # fmt: skip
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for extra in sorted(source.iterdir()):
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", index.name, "tokenizer.json"):
            shutil.copy2(extra, target / extra.name)
    shutil.copy2(source / "tokenizer.json", target / "tokenizer.json")
    return target


def convert_beside(source: Path, group_size: int = 128) -> Path:
    """``source``'s GPTQ copy in ``SOURCE-gptq`` beside it (written once, see convert), the directory that the
    benchmarks' GPTQ runs share."""
    return convert(source, source.with_name(source.name + "-gptq"), group_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--act-order", action="store_true")
    args = parser.parse_args(argv)
    print(convert(args.source, args.target, args.group_size, args.act_order))


if __name__ == "__main__":
    main()
