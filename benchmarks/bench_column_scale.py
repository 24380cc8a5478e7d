"""DoRA's in-place column scaling at the Llama-3-8B shapes: the kernel's tilings against torch's ``y.mul_(g)``.

For each output a DoRA layer scales (q, k, v, o, down at 8192 tokens), torch's ``y.mul_(g)`` (a bf16 tensor times
an FP32 vector: the type-promoting broadcast path) and every candidate tiling of
:func:`loralei.kernels.column_scale.scale_columns_` are timed (median of ``triton.testing.do_bench``) and checked
bit-identical to torch's values. The default tiling is marked; the memory rate counts one read and one write of
``y``. The summary gives one forward's scaling time over all layers (32 at 8B) for torch and the default tiling.

    python benchmarks/bench_column_scale.py --out OUT/column-scale.json                       # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_column_scale.py --shapes tiny --device cpu --out F.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kernel_bench import median_ms, parse_args, write_rows

from loralei.kernels import column_scale
from loralei.kernels.column_scale import Tiling

# shapes -> (dtype, layers, case -> (rows, columns)); fp16 where Triton's interpreter runs it (bf16 gives NaN)
SHAPES = {
    "llama3-8b": (
        torch.bfloat16,
        32,
        {"q": (8192, 4096), "k": (8192, 1024), "v": (8192, 1024), "o": (8192, 4096), "down": (8192, 4096)},
    ),
    "tiny": (torch.float16, 2, {"q": (40, 64), "k": (40, 16)}),
}


def candidates(device: torch.device) -> list[Tiling]:
    """Tiles of 8 to 64 rows and 128 to 1024 columns with 4 or 8 warps on a GPU; the default and a small tile
    elsewhere."""
    if device.type != "cuda":
        return [column_scale.GPU_TILING, Tiling(8, 16, 1)]
    return [
        Tiling(r, c, w)
        for r in (8, 16, 32, 64)
        for c in (128, 256, 512, 1024)
        for w in (4, 8)
        if r * c >= 2048
    ]


def bench_case(name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    z = torch.randn(rows, cols, device=device, generator=g).to(dtype)
    factors = torch.rand(cols, device=device, generator=g) + 0.5
    want = z.clone().mul_(factors)
    work = z.clone()  # timed in place: its values drift, the time does not depend on them
    nbytes = 2 * z.numel() * z.element_size()

    def row(launch: str, tiling: Tiling | None, ms: float, same: bool) -> dict:
        fields = tiling._asdict() if tiling else {"rows": None, "columns": None, "warps": None}
        default = tiling == column_scale.GPU_TILING
        return {
            "case": name, "shape": [rows, cols], "launch": launch, **fields, "default": default,
            "us": ms * 1e3, "tb_per_s": nbytes / ms / 1e9, "bit_identical": same,
        }  # fmt: skip

    out = [row("torch mul_", None, median_ms(lambda: work.mul_(factors), device), True)]
    for tiling in candidates(device):
        got = column_scale.scale_columns_(z.clone(), factors, None, tiling)
        ms = median_ms(lambda tiling=tiling: column_scale.scale_columns_(work, factors, None, tiling), device)
        out.append(row("kernel", tiling, ms, bool(torch.equal(got, want))))
    return out


def print_table(rows: list[dict], layers: int) -> None:
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = sorted((r for r in rows if r["case"] == case), key=lambda r: r["us"])
        print(f"{case} {mine[0]['shape']}:")
        for r in mine:
            mark = "  <- default" if r["default"] else ""
            tile = "" if r["rows"] is None else f" {r['rows']}x{r['columns']} warps {r['warps']}"
            print(f"  {r['launch']}{tile}: {r['us']:8.1f} us {r['tb_per_s']:5.2f} TB/s{mark}")
    for launch, pick in (("torch mul_", lambda r: r["rows"] is None), ("kernel", lambda r: r["default"])):
        total = sum(r["us"] for r in rows if pick(r)) * layers / 1e3
        print(f"one forward, {layers} layers, {launch}: {total:.2f} ms")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], SHAPES, argv)
    dtype, layers, cases = SHAPES[args.shapes]
    rows = [r for name, case in cases.items() for r in bench_case(name, *case, dtype, args.device)]
    print_table(rows, layers)
    write_rows(args.out, args.device, rows)
    return rows


if __name__ == "__main__":
    main()
