"""The storage count the memory tests rely on (tests/live_memory.py)."""

from __future__ import annotations

import torch

from live_memory import LiveStorage


def test_the_peak_counts_new_storage_while_it_lives_and_nothing_else() -> None:
    before = torch.ones(1000)  # not counted: it existed before
    with LiveStorage() as live:
        a = before * 2  # 4,000 bytes
        view = a[:10].view(2, 5)  # a view: no new storage
        a.add_(1)  # in place: none either
        b = a + 1  # 8,000 alive
        del a, view
        c = b * 3  # a freed: 8,000 again
        with live.pause():
            host = c.clone()  # not counted
        del b, c
        d = torch.zeros(500)  # 2,000
    assert live.peak == 8000 and live.current == 2000
    assert host.numel() == d.numel() * 2
