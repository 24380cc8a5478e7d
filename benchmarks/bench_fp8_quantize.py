"""The FP8 activation-quantization kernel's launches at the Llama-3-8B shapes: which walk of a row is fastest.

For each case (the rows an 8B step quantizes: a layer input, the gated activation, and the output gradients,
whose weight scales are folded in, of o/down, of q/k/v jointly and of gate/up jointly), every candidate launch
(:class:`loralei.kernels.fp8_operands.Launch`: one pass in registers, or two passes in blocks from 1/16 of the
row to all of it, at most 8192 columns; 4 to 32 warps) is timed (median of ``triton.testing.do_bench``) and
checked bit-identical to the default launch's result. The default
(:func:`~loralei.kernels.fp8_operands.launch_for`) is marked; the memory rate counts the bytes read (bf16) and
written (e4m3). One more row per case (``given_amax``) times the default launch given the rows' maxima, as where
the kernel that wrote the rows took them (the gated MLP's ``h`` and ``[dG dU]``): each row read once.

    python benchmarks/bench_fp8_quantize.py --out OUT/fp8-quantize.json                      # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_fp8_quantize.py --shapes tiny --device cpu --out F.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kernel_bench import median_ms, parse_args, write_rows

from loralei.kernels import fp8_operands
from loralei.kernels.fp8_operands import Launch

# shapes -> (dtype, case -> (rows, segment widths, weight scales folded in)); fp16 where Triton's interpreter runs
# it (it gives NaN for bf16)
SHAPES = {
    "llama3-8b": (
        torch.bfloat16,
        {
            "layer input": (8192, [4096], False),
            "gated activation": (8192, [14336], False),
            "dY of o / down": (8192, [4096], True),
            "dY of q/k/v": (8192, [4096, 1024, 1024], True),
            "dY of gate/up": (8192, [14336, 14336], True),
        },
    ),
    "tiny": (torch.float16, {"input": (16, [64], False), "pair": (16, [64, 32], True)}),
}
WARPS = (4, 8, 16)


def candidates(widths: list[int]) -> list[Launch]:
    """One-pass launches over the widest segment, and two-pass ones in blocks from a sixteenth of it (or 16) up
    to it (at most 8192)."""
    one_block = max(16, 1 << (max(widths) - 1).bit_length())
    blocks = [b for b in (1 << k for k in range(4, 14)) if one_block // 16 <= b <= one_block]
    two = [Launch(False, b, w) for b in blocks for w in WARPS]
    return [*two, *(Launch(True, one_block, w) for w in (4, 8, 16, 32))]


def bench_case(
    name: str, rows: int, widths: list[int], folded: bool, dtype: torch.dtype, device: torch.device
) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(rows, w, device=device, generator=g).to(dtype) for w in widths]
    factors = [torch.rand(w, device=device, generator=g) + 0.5 for w in widths] if folded else None
    want_codes, want_scales = fp8_operands.quantize_rows(xs, rows, factors)
    chosen = fp8_operands.launch_for(widths)
    nbytes = rows * sum(widths) * 3 + rows * 4
    v = torch.cat(
        [x.float() if factors is None else x.float() * f for x, f in zip(xs, factors or xs, strict=True)], 1
    )
    amax = v.abs().amax(1)
    del v
    out = []
    for launch, maxima in [*((c, None) for c in candidates(widths)), (chosen, amax)]:

        def run(
            launch: Launch = launch, maxima: torch.Tensor | None = maxima
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return fp8_operands.quantize_rows(xs, rows, factors, launch, amax=maxima)

        codes, scales = run()
        same = torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(
            scales, want_scales
        )
        ms = median_ms(run, device)
        out.append({
            "case": name, "widths": widths, "folded": folded, **launch._asdict(),
            "default": launch == chosen and maxima is None, "given_amax": maxima is not None,
            "us": ms * 1e3, "tb_per_s": nbytes / ms / 1e9, "bit_identical": bool(same),
        })  # fmt: skip
    return out


def print_table(rows: list[dict]) -> None:
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = sorted((r for r in rows if r["case"] == case), key=lambda r: r["us"])
        print(f"{case} {mine[0]['widths']}:")
        for r in mine:
            mark = (
                "  <- default"
                if r["default"]
                else "  <- default, row maxima given"
                if r["given_amax"]
                else ""
            )
            walk = "one pass" if r["one_pass"] else "two pass"
            rate = f"{r['us']:8.1f} us {r['tb_per_s']:5.2f} TB/s"
            print(f"  {walk} block {r['block']:5d} warps {r['warps']:2d}: {rate}{mark}")


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], SHAPES, argv)
    dtype, cases = SHAPES[args.shapes]
    rows = [r for name, case in cases.items() for r in bench_case(name, *case, dtype, args.device)]
    print_table(rows)
    write_rows(args.out, args.device, rows)
    return rows


if __name__ == "__main__":
    main()
