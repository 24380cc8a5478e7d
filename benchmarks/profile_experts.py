"""Where an MoE training step's time goes: routing, expert GEMMs (base, LoRA, bank gradients), activation, ...

Profiles ``--steps`` full training steps (after ``--warmup`` unprofiled ones) of any row of the train-step
benchmark (bench_rows.py) under ``torch.profiler`` and puts every unit of time into one category of
``CATEGORIES`` (first match wins). On CUDA a unit is a kernel, attributed through the profiler's event tree to the
op that launched it and that op's ancestors (a kernel no op claims keeps only its name). On CPU (the reduced form,
for the tiny-moe shape) a unit is an aten op's self CPU time. Products are told apart by their shapes (recorded
with ``record_shapes``): an operand with a dimension equal to the rank is a LoRA term; an expert bank's shape (E ×
2I × H, E × H × I, or one expert's slice of it), a width I or 2I, or the routed-row count S = tokens × top-k mark
expert work. Writes a markdown table and JSON (per step and per MoE layer) under ``--out``.

    python benchmarks/profile_experts.py --shape qwen3-30b-a3b-8l --row loralei-fused --out results/experts
    python benchmarks/profile_experts.py --shape qwen3-30b-a3b-8l --row unsloth-bf16 --out results/experts
    python benchmarks/profile_experts.py --shape tiny-moe --row peft-bf16-adapters --out /tmp/experts   # CPU

Rows that run in a child in the benchmark (Unsloth) re-run this script in a child that imports their library
first, as the benchmark's children do; rows that load a checkpoint get the shape saved once (--checkpoint-dir).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# this folder's modules, also when a child runs this file through runpy (sys.path[0] is then not this folder)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ops import sync
from bench_rows import (
    FROM_CHECKPOINT,
    ISOLATED,
    RANK,
    ROWS,
    SHAPES,
    is_moe,
    moe_layers,
    prepared_model,
    save_checkpoint,
)
from bench_train_step import CHILD_BOOT, CHILD_ENV, adamw, batch_ids, train_steps
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# Ops whose products the GEMM rules read (the outermost one in a unit's ancestry decides: a grouped GEMM over
# its per-expert mm calls, a linear over its mm).
GEMM_OPS = re.compile(r"aten::(mm|addmm_?|bmm|baddbmm|matmul|linear|einsum|_grouped_mm|_scaled_grouped_mm)$")
GROUPED = re.compile(r"grouped_mm|grouped_gemm", re.IGNORECASE)  # aten's and libraries' custom grouped ops
GEMM_KERNEL = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|matmul|grouped_mm", re.IGNORECASE)
OPTIMIZER = re.compile(r"Optimizer\.|multi_tensor|fused_adam|_foreach_", re.IGNORECASE)
ATTENTION = re.compile(r"attention|flash|fmha|sdpa|scaled_dot_product", re.IGNORECASE)
EMBED_LOSS = re.compile(r"embedding|cross_entropy|nll_loss|log_softmax", re.IGNORECASE)
ROUTING = re.compile(
    r"sort|radix|histc|histogram|cumsum|scan|topk|bincount|one_hot|nonzero|scatter|gather|index|unique",
    re.IGNORECASE,
)
EXPERT_SCOPE = re.compile(r"expert|moe", re.IGNORECASE)
LORA_SCOPE = re.compile(r"lora", re.IGNORECASE)
ACTIVATION_NAME = re.compile(r"silu|gelu|swiglu|geglu|gated_act|act_and_mul", re.IGNORECASE)
ELEMENTWISE = re.compile(
    r"aten::(mul|add|sub|rsub|div|sigmoid|silu|gelu|tanh|exp|neg|copy|clone|contiguous|to|_to_copy|fill|zero|cat"
    r"|sum|masked_fill|where|split|chunk|slice)"
)


@dataclass(frozen=True)
class Dims:
    """The widths that identify a shape's products: rank r, experts E, hidden H, expert width I, tokens T, experts
    per token K (routed rows S = T × K), attention widths q and kv."""

    rank: int
    experts: int
    hidden: int
    inter: int
    tokens: int
    top_k: int
    q: int
    kv: int

    @property
    def routed(self) -> int:
        return self.tokens * self.top_k

    @classmethod
    def of(cls, shape: str) -> Dims:
        _, cfg, batch, seq = SHAPES[shape]
        widths = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
        head = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        attention = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
        return cls(RANK, *widths, batch * seq, cfg["num_experts_per_tok"], *attention)

    def bank(self, dims: tuple[int, ...]) -> bool:
        """An expert bank (E × 2I × H, E × H × I, either order of the last two) or one expert's slice of it."""
        widths = sorted(dims[-2:])
        slices = (sorted((2 * self.inter, self.hidden)), sorted((self.hidden, self.inter)))
        return widths in slices and (len(dims) == 2 or (len(dims) == 3 and dims[0] == self.experts))

    def weight(self, dims: tuple[int, ...]) -> bool:
        """A frozen base weight: an attention projection's (either orientation) or an expert bank or slice."""
        widths = sorted(dims[-2:])
        dense = len(dims) == 2 and widths in (sorted((self.hidden, self.q)), sorted((self.hidden, self.kv)))
        return dense or self.bank(dims)

    def expert_work(self, dims: tuple[int, ...]) -> bool:
        """A tensor of the experts: a bank (or slice), per-expert 3-D, the I / 2I widths, or S routed rows."""
        return (
            self.bank(dims)
            or (len(dims) == 3 and dims[0] == self.experts)
            or any(d in (self.inter, 2 * self.inter, self.routed) for d in dims)
        )


@dataclass(frozen=True)
class Unit:
    """One unit of time: a kernel (CUDA) or an op's self time (CPU), with what the event tree says about it."""

    name: str  # the kernel's name, or the op's
    us: float
    op: str = ""  # the op that launched it ("" when no op claims the kernel)
    # that op's tensor inputs (2-D and up; offsets and scalars left out)
    shapes: tuple[tuple[int, ...], ...] = ()
    gemm: str = ""  # the outermost GEMM op among the op and its ancestors
    gemm_shapes: tuple[tuple[int, ...], ...] = ()
    ancestors: tuple[str, ...] = ()  # the op and its enclosing ops, innermost first

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.ancestors)

    def matches(self, pattern: re.Pattern) -> bool:
        return any(pattern.search(n) for n in self.names())


def _is_gemm(u: Unit) -> bool:
    return bool(u.gemm) or (not u.op and bool(GEMM_KERNEL.search(u.name)))


def _product(u: Unit) -> tuple[tuple[int, ...], int] | None:
    """The product's result shape and reduced dimension, from its two matrix operands (``None`` when the op
    does not say); a grouped product that reduces over each expert's rows gives one matrix per expert (E = -1)."""
    ops = list(u.gemm_shapes)
    if u.gemm.startswith(("aten::addmm", "aten::baddbmm")) and len(ops) == 3:
        ops = ops[1:]  # the added input first
    if len(ops) < 2 or u.gemm == "aten::einsum":
        return None
    a, b = ops[0], ops[1]
    if u.gemm == "aten::linear":  # x (..., in) and W (out, in)
        return (*a[:-1], b[0]), a[-1]
    if GROUPED.search(u.gemm) and len(a) == 2 and len(b) == 2 and a[-1] == b[0]:
        return (-1, a[0], b[1]), a[-1]
    return (*a[:-1], b[-1]), a[-1]


def _lora(u: Unit, d: Dims) -> bool:
    """A LoRA product: one with an operand of rank width, unless another operand is a base weight's 2-D matrix
    (an expert loop's product for an expert that received exactly r rows); or, inside a LoRA op (by name: loralei's
    and Unsloth's autograd Functions), one with stacked factors (a width of 2r to 8r, as q/k/v factors side by
    side) and no base weight at all."""
    if not _is_gemm(u):
        return False
    shapes = u.gemm_shapes
    weight_2d = any(len(s) == 2 and d.weight(s) for s in shapes)
    if any(d.rank in s for s in shapes):
        return not weight_2d
    stacked = any(0 < n <= 8 * d.rank and n % d.rank == 0 for s in shapes for n in s)
    return u.matches(LORA_SCOPE) and stacked and not any(d.weight(s) for s in shapes)


def _expert_gemm(u: Unit, d: Dims) -> bool:
    """A product of the experts: a grouped GEMM, one inside an experts op (by name: loralei's, Unsloth's and
    others' autograd Functions and custom ops), or one with an expert tensor (``Dims.expert_work``)."""
    marked = bool(GROUPED.search(u.gemm)) or u.matches(EXPERT_SCOPE)
    return _is_gemm(u) and (marked or any(d.expert_work(s) for s in u.gemm_shapes))


def _bank_gradient(u: Unit, d: Dims) -> bool:
    """A product whose result is an expert bank (or one expert's slice) reduced over rows (not over a width): the
    gradient of a bank that requires grad, as a merged W + BA bank does."""
    product = _product(u) if _is_gemm(u) else None
    if product is None:
        return False
    out, reduced = product
    rows = reduced not in (d.hidden, d.inter, 2 * d.inter, d.rank)
    return rows and (d.bank(out) or (len(out) == 3 and out[0] == -1))


def _router_gemm(u: Unit, d: Dims) -> bool:
    return _is_gemm(u) and any(sorted(s) == sorted((d.experts, d.hidden)) for s in u.gemm_shapes)


def _activation(u: Unit, d: Dims) -> bool:
    """The experts' gated activation: by name (aten's, Liger's, Triton's, loralei's kernels), or an elementwise
    op on routed rows of width I or 2I."""
    if ACTIVATION_NAME.search(u.name) or (u.op and ACTIVATION_NAME.search(u.op)):
        return True
    rows = [s for s in u.shapes if len(s) == 2 and s[-1] in (d.inter, 2 * d.inter)]
    return bool(ELEMENTWISE.match(u.op)) and bool(rows) and not any(len(s) == 3 for s in u.shapes)


def _routing(u: Unit, d: Dims) -> bool:
    """Router GEMM and softmax, sort / histogram / cumsum / top-k, gathers and scatters of rows, and the
    per-token combine (elementwise work on S routed rows or T × K tensors)."""
    if _router_gemm(u, d) or ROUTING.search(u.op or u.name):
        return True
    if "softmax" in u.op and any(s[-1] == d.experts for s in u.shapes):
        return True
    combine = any(s[0] == d.routed or s[:2] == (d.tokens, d.top_k) for s in u.shapes)
    return bool(ELEMENTWISE.match(u.op)) and combine


def _bank_elementwise(u: Unit, d: Dims) -> bool:
    """Elementwise work on whole expert banks (E × ...): e.g. PEFT's W + BA, or copies of a bank."""
    return any(len(s) == 3 and s[0] == d.experts and d.bank(s) for s in u.shapes)


# (category, predicate): the first category whose predicate holds takes the unit.
CATEGORIES: list[tuple[str, Callable[[Unit, Dims], bool]]] = [
    ("optimizer", lambda u, d: u.matches(OPTIMIZER)),
    ("attention", lambda u, d: u.matches(ATTENTION)),
    ("embedding / loss", lambda u, d: u.matches(EMBED_LOSS)),
    ("LoRA GEMM (experts)", lambda u, d: _lora(u, d) and _expert_gemm(u, d)),
    ("LoRA GEMM (attention)", _lora),
    ("expert GEMM (bank gradient)", _bank_gradient),
    ("expert GEMM (base)", lambda u, d: _expert_gemm(u, d) and not _router_gemm(u, d)),
    ("expert activation", _activation),
    ("routing / permute / combine", _routing),
    ("dense GEMM (q/k/v/o, lm_head)", lambda u, d: _is_gemm(u)),
    ("expert bank elementwise", _bank_elementwise),
    ("other", lambda u, d: True),
]


def classify(unit: Unit, dims: Dims) -> str:
    return next(label for label, test in CATEGORIES if test(unit, dims))


def _ancestry(ev) -> list:
    chain = []
    while ev is not None:
        chain.append(ev)
        ev = ev.cpu_parent
    return chain


def _tensor_shapes(ev) -> tuple[tuple[int, ...], ...]:
    """The op's inputs that are tensors of 2 or more dimensions (not offsets, scalars or tensor lists)."""
    shapes = ev.input_shapes or ()
    return tuple(tuple(s) for s in shapes if len(s) >= 2 and all(isinstance(n, int) for n in s))


def _unit(name: str, us: float, ev) -> Unit:
    chain = _ancestry(ev)
    gemms = [e for e in chain if GEMM_OPS.match(e.name) or GROUPED.search(e.name)]
    top = gemms[-1] if gemms else None
    return Unit(
        name=name,
        us=us,
        op=ev.name,
        shapes=_tensor_shapes(ev),
        gemm=top.name if top else "",
        gemm_shapes=_tensor_shapes(top) if top else (),
        ancestors=tuple(e.name for e in chain),
    )


def units(events, cuda: bool) -> list[Unit]:
    """The profile's units of time. CUDA: every kernel, through the op that launched it (``ev.kernels``); kernels
    that no op claims come back by name only. GPU-side copies of CPU ranges (user annotations such as
    ``Optimizer.step``, which span other kernels) are left out. CPU: every aten op's self time."""
    if not cuda:
        return [_unit(ev.name, ev.self_cpu_time_total, ev) for ev in events if ev.name.startswith("aten::")]
    ranges = {ev.name for ev in events if ev.device_type == DeviceType.CPU}
    out, claimed = [], Counter()
    for ev in events:
        if ev.device_type == DeviceType.CPU:
            for k in ev.kernels:
                if k.name not in ranges:
                    out.append(_unit(k.name, k.duration, ev))
                    claimed[k.name] += k.duration
    every = Counter()
    for ev in events:
        if ev.device_type == DeviceType.CUDA and ev.name not in ranges:
            every[ev.name] += ev.time_range.elapsed_us()
    out += [Unit(name, us - claimed[name]) for name, us in every.items() if us - claimed[name] > 0.5]
    return out


def summarise(all_units: list[Unit], dims: Dims, steps: int, layers: int) -> dict:
    """Per category: ms per step, ms per step and MoE layer, share; and its costliest kernels (or ops) with the
    op and the shapes that classified them, to check the table against a real profile."""
    by_cat: dict[str, Counter] = {label: Counter() for label, _ in CATEGORIES}
    for u in all_units:
        by_cat[classify(u, dims)][u.name[:140], u.gemm or u.op, str(list(u.gemm_shapes or u.shapes))] += u.us
    total = sum(sum(c.values()) for c in by_cat.values())
    rows = []
    for label, found in by_cat.items():
        us = sum(found.values())
        top = [
            {"kernel": k, "op": op, "shapes": sh, "ms_per_step": t / 1e3 / steps}
            for (k, op, sh), t in found.most_common(8)
        ]
        rows.append(
            {
                "category": label,
                "ms_per_step": us / 1e3 / steps,
                "ms_per_moe_layer": us / 1e3 / steps / layers,
                "share": us / total if total else 0.0,
                "top": top,
            }
        )
    return {"total_ms_per_step": total / 1e3 / steps, "categories": rows}


def write(result: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    head = f"{result['shape']} {result['row']}" + (" +liger" if result["liger"] else "")
    lines = [
        f"# Expert time split: {head}, checkpointing {result['checkpointing']}",
        "",
        f"{result['unit']}; {result['steps']} profiled steps, {result['moe_layers']} MoE layers; "
        f"{result['total_ms_per_step']:.2f} ms/step in all, {result['wall_ms_per_step']:.1f} ms/step wall "
        "(under the profiler).",
        "",
        "| category | ms / step | ms / step / MoE layer | share |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {c['category']} | {c['ms_per_step']:.3f} | {c['ms_per_moe_layer']:.3f} | {100 * c['share']:.1f} % |"
        for c in result["categories"]
        if c["ms_per_step"] > 0
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def profile_row(args, device: torch.device, dtype: torch.dtype) -> dict:
    model = prepared_model(
        args.shape, args.row, args.liger, args.checkpointing, device, dtype, args.checkpoint_dir
    )
    ids, opt = batch_ids(args.shape, device), adamw(model, device)
    train_steps(model, opt, ids, args.warmup)
    sync(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        train_steps(model, opt, ids, args.steps)
        sync(device)
        wall = (time.perf_counter() - start) / args.steps
    layers = moe_layers(args.shape)
    result = {
        "shape": args.shape,
        "row": args.row,
        "liger": args.liger,
        "checkpointing": args.checkpointing,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "unit": "CUDA kernel time" if cuda else "CPU self time of aten ops",
        "steps": args.steps,
        "moe_layers": layers,
        "wall_ms_per_step": wall * 1e3,
    }
    return result | summarise(units(prof.events(), cuda), Dims.of(args.shape), args.steps, layers)


def run_in_child(args, argv: list[str]) -> int:
    """This script again, in a process that imports the row's library first (Unsloth patches Transformers and
    PEFT when imported), through the benchmark's child boot and environment."""
    env = os.environ | CHILD_ENV | {"LORALEI_BENCH_PREIMPORT": ISOLATED[args.row]}
    cmd = [sys.executable, "-c", CHILD_BOOT, str(Path(__file__).resolve()), *argv]
    return subprocess.run(cmd, env=env, check=False).returncode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b-8l", choices=sorted(filter(is_moe, SHAPES)))
    parser.add_argument("--row", default="loralei-fused", choices=ROWS)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps (1 for the expert-loop rows)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--liger", action="store_true")
    parser.add_argument(
        "--cpu", action="store_true", help="profile on CPU (fp32) even where CUDA is available"
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="saved model of the shape for the rows that load one (saved there first when missing)",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the markdown and JSON results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    with tempfile.TemporaryDirectory(prefix="profile-ckpt-") as scratch:
        if args.row in FROM_CHECKPOINT and args.checkpoint_dir is None:
            args.checkpoint_dir = Path(scratch)
            argv = [*argv, "--checkpoint-dir", scratch]
        # as in the benchmark: tokenizer.json is written last, so a save cut short is redone
        if args.row in FROM_CHECKPOINT and not (args.checkpoint_dir / "tokenizer.json").exists():
            save_checkpoint(args.shape, args.checkpoint_dir, device, dtype)
        if args.row in ISOLATED and os.environ.get("LORALEI_BENCH_PREIMPORT") != ISOLATED[args.row]:
            code = run_in_child(args, argv)
            if code:
                raise SystemExit(f"{args.row}: the profiling child exited with code {code}")
            return None
        result = profile_row(args, device, dtype)
    stem = (
        f"experts-{args.shape}-{args.row}" + ("-liger" if args.liger else "") + "-ckpt" * args.checkpointing
    )
    write(result, args.out, stem)
    return result


if __name__ == "__main__":
    main()
