"""The summary of one profiled training step that profile_step.py and bench_runner.py (``--profile``)
write: GPU kernel time by category, the LoRA-rank matmuls among the GEMMs, and the top kernels;
bench_runner.py adds the host's side (host_summary: the top CPU ops, the host syncs). As a script it prints
the summaries saved in JSON files:

    python benchmarks/profile_summary.py OUT/profile-runner-llama3-8b-off.json [...]

``device_gaps`` finds where the device sat idle inside the profiled span (between the union of its kernels and
copies, on all streams): by gap length, and the longest gaps with what ran before and after each;
``compute_gaps`` the same without the host copies (where kernels waited for them), and in which part of the span.
``copy_overlap`` splits the host-to-device copies into the time other device work hides and the exposed rest.
``op_attribution`` charges each kernel to the op that launched it (by op, shapes and autograd node).

Categories come from kernel names (GEMM, attention, Triton activation, Liger, optimizer, elementwise/other);
matmuls with a dimension equal to the LoRA rank are reported as "LoRA GEMMs" (from op-level input shapes, so
the profile needs ``record_shapes=True``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

RANK = 16
CATEGORIES = [  # first match wins
    ("attention", r"flash|fmha|attention|sdpa"),
    ("liger (norm/rope/loss)", r"liger|_rms_norm|_rope|_cross_entropy|element_mul"),
    ("loralei triton (gated act, MLP backward)", r"gated_act|_gated"),
    ("optimizer", r"multi_tensor|fused_adam|adamw"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|sm90|matmul"),
    (
        "elementwise / reduce / copy",
        r"elementwise|vectorized|reduce|copy|fill|cat|index|softmax|norm|pow|mul|add",
    ),
]

# Host calls that wait for the device or read a device value back (each a possible stray sync in a step).
SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "aten::item",
    "aten::_local_scalar_dense",
)
# A record_function range that host_summary leaves out, with all that ran inside it: wrap the device sync that
# closes a profile in it, so that sync is not counted as the step's own.
CLOSING = "profile_summary: closing sync"
# The names of the copies between host and device memory (side streams' work, not the device computing).
HOST_COPIES = ("Memcpy HtoD", "Memcpy DtoH")


def categorise(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def lora_gemm_ms(prof) -> float:
    total = 0.0
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key in ("aten::mm", "aten::addmm", "aten::bmm") and any(
            RANK in shape for shape in ev.input_shapes if shape
        ):
            total += ev.self_device_time_total / 1e3
    return total


def summarize(prof, top: int = 25) -> dict:
    """A finished profile's GPU time: ``total_ms`` (the sum of the device events' self time),
    ``categories_ms``, ``lora_gemm_ms`` and ``top_kernels`` (the ``top`` longest: name, ms, count).

    The device's user annotations (a ``record_function`` range, such as the optimizer's
    ``Optimizer.step#AdamW.step``, spans its kernels on the GPU timeline too) are left out: they would count
    their kernels' time again (torch's own profile table leaves them out of its device total likewise)."""
    kernels = [
        ev
        for ev in prof.key_averages()
        if ev.device_type == torch.autograd.DeviceType.CUDA and not getattr(ev, "is_user_annotation", False)
    ]
    by_cat: dict[str, float] = {}
    for ev in kernels:
        by_cat[categorise(ev.key)] = by_cat.get(categorise(ev.key), 0.0) + ev.self_device_time_total / 1e3
    ranked = sorted(kernels, key=lambda ev: -ev.self_device_time_total)[:top]
    return {
        "total_ms": sum(by_cat.values()),
        "categories_ms": by_cat,
        "lora_gemm_ms": lora_gemm_ms(prof),
        "top_kernels": [(ev.key[:120], ev.self_device_time_total / 1e3, ev.count) for ev in ranked],
    }


def host_summary(prof, top: int = 15) -> dict:
    """The host's side of a finished profile: ``cpu_ops``, the ``top`` CPU-side ops and runtime calls by
    self CPU time (name, count, self and total ms), and ``host_syncs``, the count, self and total ms of each
    call in SYNCS (zero where none ran). What started inside a ``record_function(CLOSING)`` range is left
    out."""
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CPU]
    closing = [ev.time_range for ev in events if ev.name == CLOSING]
    ops: dict[str, dict] = {}
    for ev in events:
        if any(span.start <= ev.time_range.start <= span.end for span in closing):
            continue
        op = ops.setdefault(ev.name, {"name": ev.name, "count": 0, "self_ms": 0.0, "total_ms": 0.0})
        op["count"] += 1
        op["self_ms"] += ev.self_cpu_time_total / 1e3
        op["total_ms"] += ev.cpu_time_total / 1e3
    ranked = sorted(ops.values(), key=lambda op: -op["self_ms"])[:top]
    none = {"count": 0, "self_ms": 0.0, "total_ms": 0.0}
    syncs = {name: {k: v for k, v in ops.get(name, none).items() if k != "name"} for name in SYNCS}
    return {"cpu_ops": ranked, "host_syncs": syncs}


def _node(event) -> str:
    """The nearest range around ``event`` that is not an aten op or a runtime call: the autograd node (an
    ``autograd.Function``'s forward or backward, an engine step) or a user range; "" at top level."""
    parent = event.cpu_parent
    while parent is not None and parent.name.startswith(("aten::", "cuda")):
        parent = parent.cpu_parent
    return parent.name if parent is not None else ""


def op_attribution(prof, top: int = 40) -> dict:
    """``by_op``: the device time of each kernel charged to the CPU op that launched it, summed by op, input
    shapes and enclosing node (:func:`_node`), the ``top`` rows as (ms, ops, key). Kernels replayed from a CUDA
    graph have no launching op: profile an eager step for this (bench_runner's ``--no-cuda-graphs``)."""
    rows: dict[str, list] = {}
    for ev in prof.events():
        kernels = getattr(ev, "kernels", None)
        if ev.device_type != torch.autograd.DeviceType.CPU or not kernels:
            continue
        row = rows.setdefault(f"{ev.name} {ev.input_shapes} in {_node(ev)}", [0.0, 0])
        row[0] += sum(kernel.duration for kernel in kernels) / 1e3
        row[1] += 1
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]
    return {"by_op": [(ms, count, key[:200]) for key, (ms, count) in ranked]}


GAP_BUCKETS_US = (10.0, 100.0, 1000.0)  # upper bounds of the gap classes; the last class is open


def _bucket(gap_us: float) -> str:
    low = 0.0
    for high in GAP_BUCKETS_US:
        if gap_us < high:
            return f"{low:g}-{high:g} us"
        low = high
    return f">={low:g} us"


def _device_spans(prof, copies: bool = True) -> list[tuple[float, float, str]]:
    """The device's events (kernels, fills and, with ``copies``, host copies; user annotations left out) as
    sorted (start us, end us, name)."""
    return sorted(
        (ev.time_range.start, ev.time_range.end, ev.name)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(ev, "is_user_annotation", False)
        and (copies or not ev.name.startswith(HOST_COPIES))
    )


def _gaps(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """The idle spans between the union of ``spans``: (gap us, its start us, the event before, the event after)."""
    gaps: list[tuple[float, float, str, str]] = []
    if spans:
        reach, last = spans[0][1], spans[0][2]
        for start, end, name in spans[1:]:
            if start > reach:
                gaps.append((start - reach, reach, last, name))
            if end >= reach:
                reach, last = end, name
    return gaps


def device_gaps(prof, top: int = 8) -> dict:
    """Where the device sat idle between the first and the last of its events (kernels, copies, fills on any
    stream; user annotations left out): ``idle_ms``, ``gaps_by_length`` (class -> count, ms; classes from
    GAP_BUCKETS_US) and ``longest_gaps`` (the ``top`` longest: us, the event before, the event after)."""
    gaps = _gaps(_device_spans(prof))
    by_length = {_bucket(low): {"count": 0, "ms": 0.0} for low in (0.0, *GAP_BUCKETS_US)}
    for gap, *_ in gaps:
        entry = by_length[_bucket(gap)]
        entry["count"] += 1
        entry["ms"] += gap / 1e3
    longest = sorted(gaps, key=lambda g: -g[0])[:top]
    return {
        "idle_ms": sum(entry["ms"] for entry in by_length.values()),
        "gaps_by_length": by_length,
        "longest_gaps": [(gap, before[:80], after[:80]) for gap, _, before, after in longest],
    }


def compute_gaps(prof, top: int = 12, parts: int = 10) -> dict:
    """Where the device computed nothing between its first and last kernel: idle as :func:`device_gaps` finds
    it, but with the host copies (``Memcpy HtoD`` / ``DtoH``, on their side streams) left out, so the time
    kernels waited for copies counts. ``compute_idle_ms``; ``compute_idle_by_part`` (ms idle in each of
    ``parts`` equal parts of the span, first to last: the forward's share against the backward's);
    ``compute_longest_gaps`` (the ``top`` longest: us, ms from the span's start, the kernel before, after)."""
    spans = _device_spans(prof, copies=False)
    gaps = _gaps(spans)
    by_part = [0.0] * parts
    if gaps:
        first, width = spans[0][0], (max(end for _, end, _ in spans) - spans[0][0]) / parts
        for gap, start, _, _ in gaps:
            for part in range(parts):  # a gap's share of each part it covers
                low, high = first + part * width, first + (part + 1) * width
                by_part[part] += max(0.0, min(start + gap, high) - max(start, low)) / 1e3
    longest = sorted(gaps, key=lambda g: -g[0])[:top]
    origin = spans[0][0] if spans else 0.0
    return {
        "compute_idle_ms": sum(gap for gap, *_ in gaps) / 1e3,
        "compute_idle_by_part": by_part,
        "compute_longest_gaps": [
            (gap, (start - origin) / 1e3, before[:80], after[:80]) for gap, start, before, after in longest
        ],
    }


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``spans`` as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Microseconds that two sets of disjoint sorted intervals share."""
    shared, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


def copy_overlap(prof) -> dict:
    """How the host-to-device copies (``Memcpy HtoD``: streamed layer weights, offloaded layer inputs) overlap
    the device's other work: ``h2d_copy_ms`` (their union), ``h2d_hidden_ms`` (the part under other device events,
    on any stream) and ``h2d_exposed_ms`` (the rest: the device did nothing else, waiting for them)."""
    copies, other = [], []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or getattr(ev, "is_user_annotation", False):
            continue
        (copies if ev.name.startswith("Memcpy HtoD") else other).append(
            (ev.time_range.start, ev.time_range.end)
        )
    copies, other = _merged(copies), _merged(other)
    total = sum(end - start for start, end in copies)
    hidden = _overlap_us(copies, other)
    return {
        "h2d_copy_ms": total / 1e3,
        "h2d_hidden_ms": hidden / 1e3,
        "h2d_exposed_ms": (total - hidden) / 1e3,
    }


def title(result: dict) -> str:
    """``SHAPE ROW[ +liger] ckpt=CHECKPOINTING``, from the result's keys."""
    liger = " +liger" if result.get("liger") else ""
    return f"{result['shape']} {result['row']}{liger} ckpt={result['checkpointing']}"


def print_summary(result: dict) -> None:
    """Prints a summary (``summarize``'s keys and the shape, row and checkpointing it was taken at; the wall
    clock against the GPU's busy time (``wall_ms``, ``gpu_busy_ms``), ``device_gaps``' and ``host_summary``'s
    keys where present)."""
    total = result["total_ms"]
    print(f"{title(result)}: {total:.1f} ms")
    for label, ms in sorted(result["categories_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {label:30s} {ms:8.1f} ms  {100 * ms / total:5.1f} %")
    print(f"  (of GEMM: LoRA-rank matmuls {result['lora_gemm_ms']:.1f} ms)")
    for name, ms, count in result["top_kernels"]:
        print(f"    {ms:8.2f} ms  x{count:<5d} {name[:100]}")
    if "wall_ms" in result:
        wall, busy = result["wall_ms"], result["gpu_busy_ms"]
        share = f"{100 * busy / wall:.1f} % of wall"
        print(f"  profiled step: wall {wall:.1f} ms, GPU busy {busy:.1f} ms ({share})")
    if "idle_ms" in result:
        print(f"  device idle between its first and last event: {result['idle_ms']:.1f} ms, by gap length:")
        for label, entry in result["gaps_by_length"].items():
            print(f"    {entry['ms']:8.2f} ms  x{entry['count']:<5d} {label}")
        for gap, before, after in result["longest_gaps"]:
            print(f"    {gap:8.0f} us  after {before[:45]}  before {after[:45]}")
    if "compute_idle_ms" in result:
        parts = " ".join(f"{ms:.1f}" for ms in result["compute_idle_by_part"])
        print(
            f"  no kernel running (host copies left out): {result['compute_idle_ms']:.1f} ms; by tenth: {parts}"
        )
        for gap, at, before, after in result["compute_longest_gaps"]:
            print(f"    {gap:8.0f} us  at {at:7.1f} ms  after {before[:40]}  before {after[:40]}")
    if "h2d_copy_ms" in result:
        copied, exposed = result["h2d_copy_ms"], result["h2d_exposed_ms"]
        print(
            f"  host-to-device copies: {copied:.1f} ms, {exposed:.1f} ms of it with nothing else on the device"
        )
    if result.get("by_op"):
        print("  device time by launching op, input shapes and node (ms, ops):")
        for ms, count, key in result["by_op"][:15]:
            print(f"    {ms:8.2f} ms  x{count:<5d} {key[:110]}")
    if "host_syncs" in result:
        print("  host syncs (total ms, count):")
        for name, sync in result["host_syncs"].items():
            print(f"    {sync['total_ms']:8.2f} ms  x{sync['count']:<5d} {name}")
    if "cpu_ops" in result:
        print("  CPU ops by self time (self ms, total ms, count):")
        for op in result["cpu_ops"]:
            ms = f"{op['self_ms']:8.2f} ms {op['total_ms']:8.2f} ms"
            print(f"    {ms}  x{op['count']:<5d} {op['name'][:90]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="print saved profile summaries")
    parser.add_argument(
        "files", type=Path, nargs="+", help="JSON files of profile_step.py or bench_runner --profile"
    )
    for path in parser.parse_args(argv).files:
        print_summary(json.loads(path.read_text()))


if __name__ == "__main__":
    main()
