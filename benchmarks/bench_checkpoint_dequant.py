"""Checkpoint-weight dequantization at the Llama-3-8B shapes: the Triton kernels vs the torch unpacking and NF4's.

For each projection shape and checkpoint format (GPTQ with and without act-order, AWQ, NVFP4; groups of 128)
times (median of ``triton.testing.do_bench`` on the GPU) writing the dense weight into a reused buffer, as a product
of the dequantize backend does: (a) the format's Triton kernel (:mod:`loralei.kernels.checkpoint_dequant`),
(b) the torch unpacking copied into the buffer (the path before the kernels), (c) the NF4 dequantization kernel
of a TorchAO-packed weight of the same shape; and checks that (a) gives (b)'s bits. The stored tensors are random
but of the format's shapes and dtypes (its parts, as data).

    python benchmarks/bench_checkpoint_dequant.py --out OUT/checkpoint-dequant.json                # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_checkpoint_dequant.py --shapes tiny --device cpu --out F.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench_nf4 import packed_weight
from kernel_bench import median_ms, parse_args, write_rows

from loralei.kernels import nf4
from loralei.modules.quantized.checkpoint_formats import FORMATS, Dims, QuantSpec, groups_of

# shapes -> (dtype, projection -> (out, in)); fp16 where Triton's interpreter runs it (it gives NaN for bf16)
SHAPES = {
    "llama3-8b": (torch.bfloat16, {"q_o": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}),
    "tiny": (torch.float16, {"tiny": (64, 256)}),
}
SPECS = {
    "gptq act-order": QuantSpec("gptq", 128, True, 1),
    "gptq": QuantSpec("gptq", 128, False, 1),
    "awq": QuantSpec("awq", 128),
    "nvfp4": QuantSpec("nvfp4", 16),
}


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random stored values of ``dtype``: any bits for packed codes, small positive scales otherwise."""
    if dtype in (torch.int32, torch.uint8):
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, dtype=dtype, device=device)
    return (torch.rand(shape, device=device) * 0.01 + 1e-3).to(dtype)


def stored_tensors(spec: QuantSpec, out: int, inp: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random tensors of one linear stored in ``spec``'s format (its kept parts; ``g_idx`` a permuted group map
    with act-order, else absent)."""
    dims = Dims(out, inp, groups_of(spec, inp))
    parts = {
        p.name: _random(p.shape(dims), p.dtypes[0], device)
        for p in FORMATS[spec.method].parts
        if p.kept and p.name != "g_idx"
    }
    if spec.act_order:
        parts["g_idx"] = (torch.randperm(inp, device=device) // spec.group_size).to(torch.int32)
    return parts


def bench_format(
    proj: str, label: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, nf4_ms: float
) -> dict:
    """Times the kernel and the torch unpacking of one format at one shape; returns the table row."""
    spec = SPECS[label]
    t, fmt = stored_tensors(spec, *shape, device), FORMATS[spec.method]
    kernel_out = torch.empty(shape, dtype=dtype, device=device)
    torch_out = torch.empty_like(kernel_out)
    kernel_ms = median_ms(lambda: fmt.write(t, spec, kernel_out), device)
    torch_ms = median_ms(lambda: torch_out.copy_(fmt.dequantize(t, spec, dtype)), device)
    nbytes = sum(x.numel() * x.element_size() for x in t.values()) + kernel_out.nbytes
    return {
        "proj": proj, "format": label, "out": shape[0], "in": shape[1], "kernel_ms": kernel_ms,
        "torch_ms": torch_ms, "nf4_ms": nf4_ms, "kernel_vs_nf4": kernel_ms / nf4_ms,
        "kernel_tb_per_s": nbytes / kernel_ms / 1e9, "bit_identical": torch.equal(kernel_out, torch_out),
    }  # fmt: skip


def nf4_ms(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> float:
    """The NF4 dequantization kernel's time for a TorchAO-packed weight of ``shape``."""
    p = packed_weight(*shape, device, dtype)
    w = torch.empty(shape, dtype=dtype, device=device)
    return median_ms(lambda: nf4.dequantize(p, w), device)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'proj':8} {'format':15} {'out':>6} {'in':>6} {'kernel ms':>9} {'TB/s':>5} {'torch ms':>8} {'nf4 ms':>7}"
    )
    for r in rows:
        print(
            f"{r['proj']:8} {r['format']:15} {r['out']:6d} {r['in']:6d} {r['kernel_ms']:9.3f} "
            f"{r['kernel_tb_per_s']:5.2f} {r['torch_ms']:8.3f} {r['nf4_ms']:7.3f}"
            + ("" if r["bit_identical"] else "  NOT BIT-IDENTICAL")
        )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], SHAPES, argv)
    dtype, shapes = SHAPES[args.shapes]
    rows = []
    for proj, shape in shapes.items():
        nf4_time = nf4_ms(shape, dtype, args.device)
        rows += [bench_format(proj, label, shape, dtype, args.device, nf4_time) for label in SPECS]
    print_table(rows)
    write_rows(args.out, args.device, rows)
    return rows


if __name__ == "__main__":
    main()
