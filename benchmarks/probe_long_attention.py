"""Causal attention at one long sequence (Llama-3-8B heads: 32 query, 8 key/value, 128 dims), forward and
backward, through each of PyTorch's SDPA backends and the one it picks itself, with q/k/v laid out as Transformers
gives them (a transposed view of the projections' (T, heads, dim) output) and contiguous: ms and TFLOP/s.

Usage: python benchmarks/probe_long_attention.py --tokens 32768 65536 --out probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, DIM = 32, 8, 128
BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
ATTENTION_MARKS = ("attention", "sdpa", "fmha", "flash")  # in the names of attention kernels


def operands(tokens: int, contiguous: bool) -> list[torch.Tensor]:
    """q, k, v (1, heads, T, 128) with grads; k/v heads repeated to 32 as Transformers' sdpa path does."""

    def one(heads: int) -> torch.Tensor:
        x = torch.randn(1, tokens, heads, DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return x.contiguous() if contiguous else x

    q, k, v = one(HEADS), one(KV_HEADS), one(KV_HEADS)
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    return [t.detach().requires_grad_() for t in (q, k, v)]


def timed(tokens: int, backend: SDPBackend | None, contiguous: bool, repeats: int = 3) -> float:
    q, k, v = operands(tokens, contiguous)
    grad = torch.randn_like(q)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    context = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    with context:
        step()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            step()
        stop.record()
        torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def kernels(tokens: int) -> list[str]:
    """The GPU kernels of one default forward and backward."""
    q, k, v = operands(tokens, contiguous=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    return sorted({e.key[:90] for e in prof.key_averages() if any(m in e.key for m in ATTENTION_MARKS)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        flops = 4 * HEADS * DIM * tokens * tokens / 2 * 3.5  # causal: half the scores; backward 2.5× forward
        for name, backend in BACKENDS.items():
            for contiguous in (False, True):
                try:
                    ms = timed(tokens, backend, contiguous)
                    row = {"ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)}
                except RuntimeError as error:
                    row = {"error": str(error).splitlines()[0][:200]}
                rows.append({"tokens": tokens, "backend": name, "contiguous": contiguous, **row})
                print(rows[-1], flush=True)
        rows.append({"tokens": tokens, "default_kernels": kernels(tokens)})
        print(rows[-1], flush=True)
    found = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
