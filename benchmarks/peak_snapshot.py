"""What is allocated on the device at a step's peak, and which code allocated it: PyTorch's allocator history
(``torch.cuda.memory._record_memory_history``) replayed to the moment the allocations made since recording
started peak, the blocks alive then grouped by the two innermost frames of loralei or Transformers that made them.

Used by ``memory_step.py --snapshot``; :func:`alive_at_peak` and :func:`grouped` take the snapshot's event list
and run anywhere (tested on the CPU with made-up events).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

OURS = ("/loralei/", "/transformers/")  # the code whose frames name a block
MAX_EVENTS = 1_000_000


def record() -> None:
    """Starts recording every allocation and free with its Python stack."""
    torch.cuda.memory._record_memory_history(max_entries=MAX_EVENTS, stacks="python")


def stop() -> list[dict[str, Any]]:
    """Stops recording; the current device's events since :func:`record`."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot["device_traces"][torch.cuda.current_device()]


def alive_at_peak(events: Iterable[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The largest sum of bytes allocated and not yet freed over ``events`` (allocations before the first event
    are not counted), and the allocation events of the blocks alive at that moment."""
    alive: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for event in events:
        action = event["action"]
        if action == "alloc":
            alive[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(alive.values())
        elif action in ("free_requested", "free_completed") and event["addr"] in alive:
            total -= alive.pop(event["addr"])["size"]
    return peak, at_peak


def _ours(frame: dict[str, Any]) -> str | None:
    """``path:line function`` (path from the package on) of a frame in loralei or Transformers, else None."""
    for root in OURS:
        if root in frame["filename"]:
            return f"{root.strip('/')}/{frame['filename'].split(root, 1)[1]}:{frame['line']} {frame['name']}"
    return None


def _where(frames: list[dict[str, Any]]) -> str:
    """The two innermost frames in loralei or Transformers (the allocating line and its caller, `` < ``
    between them), the innermost frame at all when there is none, or ``(no Python frame)``."""
    ours = [where for frame in frames if (where := _ours(frame)) is not None][:2]
    if ours:
        return " < ".join(ours)
    if frames:
        return f"{frames[0]['filename'].rsplit('/', 2)[-1]}:{frames[0]['line']} {frames[0]['name']}"
    return "(no Python frame)"


def grouped(blocks: Iterable[dict[str, Any]], tokens: int, top: int = 40) -> list[dict[str, Any]]:
    """``blocks`` summed by where they were allocated, largest first: bytes, count and bytes per token."""
    sums: dict[str, list[int]] = {}
    for block in blocks:
        entry = sums.setdefault(_where(block.get("frames", [])), [0, 0])
        entry[0] += block["size"]
        entry[1] += 1
    rows = sorted(sums.items(), key=lambda item: -item[1][0])[:top]
    return [
        {"where": where, "bytes": size, "count": count, "bytes_per_token": round(size / tokens, 1)}
        for where, (size, count) in rows
    ]
