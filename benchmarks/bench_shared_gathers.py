"""The shared-prompt attention's four gathers a layer (queries, keys, values into the virtual rows; the outputs back),
forward and backward, at the DPO bar's batch: ``index_select`` with torch's backward (atomic adds into zeros) against
the gathers whose backward is :func:`loralei.kernels.gather_sum.gather_sum`, and their gradients checked equal.

The batch is :mod:`bench_dpo`'s at the Llama-3-8B shape: 4 pairs, 1,024-token sequences of which 256 prompt
tokens, collated with each prompt stored once (4 rows of 1,793 tokens; 8 virtual rows of 1,024). The summary gives
one step's backward of the gathers over all layers (32 at 8B).

    python benchmarks/bench_shared_gathers.py --out OUT/shared-gathers.json                    # on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_shared_gathers.py --shapes tiny --device cpu --out F.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from kernel_bench import median_ms, parse_args, write_rows

from loralei.train import shared_prompt
from loralei.train.data import make_collator
from loralei.train.data.preference_collate import PreferenceCollator
from loralei.train.losses import PAIR_OUTPUT_TOKENS, PAIR_OUTPUTS, PAIR_PLACES, PAIR_ROWS

# shapes -> (dtype, layers, pairs, prompt tokens, sequence tokens, query heads, key/value heads, head dim)
SHAPES = {
    "llama3-8b": (torch.bfloat16, 32, 4, 256, 1024, 32, 8, 128),
    "tiny": (torch.float16, 2, 2, 5, 16, 4, 2, 8),
}


def _batch(pairs: int, prompt: int, seq: int) -> dict[str, torch.Tensor]:
    """The pairs collated with their prompts stored once (the completions differ from their first token)."""
    rng = np.random.default_rng(0)
    items = []
    for index in range(pairs):
        ids = [rng.integers(3, 1000, seq) for _ in range(2)]
        ids[1][:prompt] = ids[0][:prompt]
        ids[1][prompt] = ids[0][prompt] + 1
        labels = [np.where(np.arange(seq) < prompt, -100, s) for s in ids]
        items.append((index, (ids[0], labels[0]), (ids[1], labels[1])))
    base = make_collator(
        0, max_seq_length=2 * seq, pad_to_max_length=False, packed=False, attention_mask=True
    )
    return PreferenceCollator(base, share_prompt=True)([{"pairs": [item]} for item in items])


def _gathers(states: list[torch.Tensor], maps: dict, kernel: bool) -> list[torch.Tensor]:
    """The layer's gathers: each of ``states`` (stored tokens' (rows, heads, dim)) into the virtual rows, then the
    first (as the attention's outputs) back to the stored tokens."""
    rows, outputs = maps[PAIR_ROWS].flatten(), maps[PAIR_OUTPUTS].flatten()
    if kernel:
        places = maps[PAIR_PLACES].view(-1, 2)
        virtual = [shared_prompt._Gather.apply(s, rows, places) for s in states]
        back = shared_prompt._Gather.apply(virtual[0], outputs, maps[PAIR_OUTPUT_TOKENS].flatten())
    else:
        virtual = [s.index_select(0, rows) for s in states]
        back = virtual[0].index_select(0, outputs)
    return [*virtual, back]


def bench(shape: str, device: torch.device) -> list[dict]:
    dtype, layers, pairs, prompt, seq, heads, kv_heads, dim = SHAPES[shape]
    maps = {k: v.to(device) for k, v in _batch(pairs, prompt, seq).items() if k.startswith("pair_")}
    tokens = maps[PAIR_OUTPUTS].numel()
    g = torch.Generator(device=device).manual_seed(0)
    states = [
        torch.randn(tokens, h, dim, device=device, generator=g).to(dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]
    outs = _gathers(states, maps, kernel=False)
    grads = [torch.randn_like(o) for o in outs]
    rows: list[dict] = []
    want = torch.autograd.grad(outs, states, grads)
    for kernel in (False, True):
        outs = _gathers(states, maps, kernel)
        got = torch.autograd.grad(outs, states, grads, retain_graph=True)
        ms = median_ms(lambda outs=outs: torch.autograd.grad(outs, states, grads, retain_graph=True), device)
        rows.append({
            "launch": "gather_sum kernel" if kernel else "index_select (atomic index_add_ backward)",
            "tokens": tokens, "virtual_rows": list(maps[PAIR_ROWS].shape), "backward_us": ms * 1e3,
            "step_ms": ms * layers, "same_grads": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
        })  # fmt: skip
        print(
            f"{rows[-1]['launch']}: {ms * 1e3:.1f} us a layer, {ms * layers:.2f} ms a step; same: {rows[-1]['same_grads']}"
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(__doc__.splitlines()[0], SHAPES, argv)
    rows = bench(args.shapes, args.device)
    write_rows(args.out, args.device, rows)
    return rows


if __name__ == "__main__":
    main()
