"""DoRA's per-step row norms ``‖W + s B A‖_row`` at the Llama-3-8B shapes: the Triton pass against torch's.

For each projection of a layer (r = 16, bf16 base and factors, 8B shapes), ``loralei.ops.dora.row_norms`` is
timed (median of ``triton.testing.do_bench``) with the kernel (:mod:`loralei.kernels.dora_norms`, after the
small ``A Aᵀ``) and with torch's passes, and the two results compared (largest relative difference). The memory
rate counts one read of ``W``. The summary gives one forward's norms over all layers (32 at 8B) both ways.

    python benchmarks/bench_dora_norms.py --out OUT/dora-norms.json                       # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_dora_norms.py --shapes tiny --device cpu --out F.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kernel_bench import median_ms, parse_args, write_rows

from loralei.kernels import dora_norms
from loralei.ops.dora import row_norms, squared_row_norms
from loralei.ops.weights import LoRAWeights

# shapes -> (dtype, layers, rank, case -> (out, in)); fp16 where Triton's interpreter runs it (bf16 gives NaN)
SHAPES = {
    "llama3-8b": (
        torch.bfloat16,
        32,
        16,
        {
            "q": (4096, 4096),
            "k": (1024, 4096),
            "v": (1024, 4096),
            "o": (4096, 4096),
            "gate": (14336, 4096),
            "up": (14336, 4096),
            "down": (4096, 14336),
        },
    ),
    "tiny": (torch.float16, 2, 4, {"q": (48, 40), "down": (40, 72)}),
}


def bench_case(
    name: str, n_out: int, n_in: int, rank: int, dtype: torch.dtype, device: torch.device
) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    w = LoRAWeights(
        W=(torch.randn(n_out, n_in, device=device, generator=g) / n_in**0.5).to(dtype),
        quant=None,
        A=(torch.randn(rank, n_in, device=device, generator=g) / n_in**0.5).to(dtype),
        B=(torch.randn(n_out, rank, device=device, generator=g) / rank**0.5).to(dtype),
        scale=2.0,
        dropout_p=0.0,
        bias=None,
    )
    w_sq = squared_row_norms(w)
    assert dora_norms.usable(w.W, w.A, w.B, w_sq), "the kernel does not run here"
    kernel = row_norms(w, w_sq)
    kernel_ms = median_ms(lambda: row_norms(w, w_sq), device)
    with mock.patch.object(dora_norms, "usable", lambda *a: False):
        torch_norms = row_norms(w, w_sq)
        torch_ms = median_ms(lambda: row_norms(w, w_sq), device)
    diff = ((kernel - torch_norms).abs() / torch_norms.abs().clamp_min(1e-30)).max().item()
    nbytes = w.W.numel() * w.W.element_size()
    return [
        {"case": name, "shape": [n_out, n_in], "launch": launch, "us": ms * 1e3, "tb_per_s": nbytes / ms / 1e9,
         "max_rel_diff": diff}
        for launch, ms in (("torch passes", torch_ms), ("kernel", kernel_ms))
    ]  # fmt: skip


def print_table(rows: list[dict], layers: int) -> None:
    for r in rows:
        print(f"{r['case']} {r['shape']} {r['launch']}: {r['us']:8.1f} us {r['tb_per_s']:5.2f} TB/s of W")
    print(f"largest relative difference, kernel vs torch: {max(r['max_rel_diff'] for r in rows):.2e}")
    for launch in ("torch passes", "kernel"):
        total = sum(r["us"] for r in rows if r["launch"] == launch) * layers / 1e3
        print(f"one forward, {layers} layers, {launch}: {total:.2f} ms")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], SHAPES, argv)
    dtype, layers, rank, cases = SHAPES[args.shapes]
    rows = [r for name, case in cases.items() for r in bench_case(name, *case, rank, dtype, args.device)]
    print_table(rows, layers)
    write_rows(args.out, args.device, rows)
    return rows


if __name__ == "__main__":
    main()
