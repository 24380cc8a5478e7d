"""benchmarks/peak_snapshot.py on made-up allocator events: the replay finds the peak of the step's allocations
and the blocks alive then, and groups them by the innermost loralei or Transformers frame."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peak_snapshot


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


ATTENTION = [
    frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "sdpa"),
    frame("/site-packages/transformers/integrations/sdpa_attention.py", 96, "sdpa_attention_forward"),
    frame("/repo/src/loralei/train/run.py", 5, "train"),
]
MLP = [frame("/repo/src/loralei/ops/lora_mlp.py", 42, "forward")]


def alloc(addr: int, size: int, frames: list[dict]) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames}


def free(addr: int, action: str = "free_requested") -> dict:
    return {"action": action, "addr": addr, "size": 0, "frames": []}


EVENTS = [
    free(99),  # a block from before recording: not counted
    alloc(1, 100, ATTENTION),
    alloc(2, 300, MLP),
    free(2),
    alloc(3, 250, MLP),
    alloc(4, 60, []),  # peak here: 1, 3, 4 alive (410 bytes)
    free(3, "free_completed"),
    free(4),
    alloc(5, 120, MLP),
]


def test_the_replay_finds_the_peak_and_the_blocks_alive_there():
    peak, blocks = peak_snapshot.alive_at_peak(EVENTS)
    assert peak == 410
    assert sorted(b["addr"] for b in blocks) == [1, 3, 4]


def test_blocks_are_grouped_by_the_two_innermost_frames_of_ours():
    _, blocks = peak_snapshot.alive_at_peak(EVENTS)
    rows = peak_snapshot.grouped(blocks, tokens=10)
    assert rows == [
        {"where": "loralei/ops/lora_mlp.py:42 forward", "bytes": 250, "count": 1, "bytes_per_token": 25.0},
        {
            "where": "transformers/integrations/sdpa_attention.py:96 sdpa_attention_forward < "
            "loralei/train/run.py:5 train",
            "bytes": 100,
            "count": 1,
            "bytes_per_token": 10.0,
        },
        {"where": "(no Python frame)", "bytes": 60, "count": 1, "bytes_per_token": 6.0},
    ]
