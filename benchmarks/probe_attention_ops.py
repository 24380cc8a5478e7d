"""Causal GQA attention at one long sequence (Llama-3-8B heads) through SDPA and through the private op SDPA picks
(``torch._fused_sdp_choice``), called directly: which backend, whether the op takes 8 key/value heads, whether its
output and gradients equal SDPA's bit for bit, and the time of the forward alone against forward + backward
(median milliseconds, kernel_bench.median_ms).

    python benchmarks/probe_attention_ops.py --tokens 32768 65536 --out probe.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_bench import median_ms

HEADS, KV_HEADS, DIM = 32, 8, 128
CUDA = torch.device("cuda")


def operands(tokens: int) -> list[torch.Tensor]:
    def one(heads: int) -> torch.Tensor:
        x = torch.randn(1, tokens, heads, DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        return x.detach().requires_grad_()

    return [one(HEADS), one(KV_HEADS), one(KV_HEADS)]


def probe(tokens: int) -> dict:
    q, k, v = operands(tokens)
    grad = torch.randn_like(q)
    row: dict = {
        "tokens": tokens,
        "choice": int(torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True)),
    }
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    again = torch.autograd.grad(
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v), grad
    )
    row["sdpa_grads_repeat"] = [bool(torch.equal(a, b)) for a, b in zip(again, ref_grads, strict=True)]
    row["sdpa_fwd_ms"] = median_ms(
        lambda: F.scaled_dot_product_attention(
            q.detach(), k.detach(), v.detach(), is_causal=True, enable_gqa=True
        ),
        CUDA,
    )
    row["sdpa_fwd_bwd_ms"] = median_ms(
        lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v), grad
        ),
        CUDA,
    )
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    try:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(qd, kd, vd, None, True, 0.0, True, False)
        o, lse = out[0], out[1]
        row["cudnn_out_equal"] = bool(torch.equal(o, ref))
        row["cudnn_lse"] = [list(lse.shape), str(lse.dtype), list(lse.stride())]
        row["cudnn_out_stride"] = list(o.stride())

        def backward() -> tuple:
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                grad, qd, kd, vd, o, lse, out[6], out[7], None, out[2], out[3], out[4], out[5], 0.0, True
            )

        grads = backward()
        row["cudnn_grads_equal"] = [
            bool(torch.equal(a, b)) for a, b in zip(grads[:3], ref_grads, strict=True)
        ]
        row["cudnn_grad_shapes"] = [list(g.shape) for g in grads]
        row["cudnn_bwd_ms"] = median_ms(backward, CUDA)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        backward()
        row["cudnn_bwd_extra_bytes_per_token"] = (torch.cuda.max_memory_allocated() - base) / tokens
    except RuntimeError as error:
        row["cudnn_error"] = str(error).splitlines()[0][:300]
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), (q, k, v), grad
    )
    row["sdpa_fwd_bwd_extra_bytes_per_token"] = (torch.cuda.max_memory_allocated() - base) / tokens
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        rows.append(probe(tokens))
        print(rows[-1], flush=True)
    found = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    args.out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
