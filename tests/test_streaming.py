"""StreamingLLM against a loop reference, and its timing rule."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from kvtrim.cache import TrimLayer


def ref_streaming(n: int, sink: int, budget: int) -> list[int]:
    """Positions StreamingLLM holds after n tokens: a rolling cache of `budget` with `sink` pinned."""
    kept: list[int] = []
    for t in range(n):
        kept.append(t)
        if len(kept) > budget:
            del kept[sink]  # the oldest non-sink entry leaves
    return kept


@pytest.mark.parametrize("sink,budget", [(4, 10), (0, 7), (2, 3)])
@pytest.mark.parametrize("arrivals", [[40], [1] * 40, [13, 1, 1, 25]])
def test_budget_mode_matches_rolling_reference_and_never_exceeds_budget(sink, budget, arrivals):
    keys = torch.randn(2, 3, sum(arrivals), 4)
    layer = TrimLayer(kvtrim.StreamingLLM(sink_size=sink, budget=budget), 0)
    pos = 0
    for size in arrivals:
        layer.update(keys[:, :, pos : pos + size], keys[:, :, pos : pos + size])
        pos += size
        assert layer.stored == min(pos, budget)
        want = ref_streaming(pos, sink, budget)
        settled = layer.copy()
        settled.settle()  # in position order (single-token arrivals decode in place, in slot order)
        assert (settled.positions == torch.tensor(want)).all()
        assert torch.equal(settled.keys[0, 1], keys[0, 1, want])


def test_ratio_mode_compresses_the_prefill_once():
    keys = torch.randn(1, 2, 110, 4)
    layer = TrimLayer(kvtrim.StreamingLLM(sink_size=4, compression_ratio=0.75), 0)
    layer.update(keys[:, :, :100], keys[:, :, :100])
    layer.end_prompt()  # a standalone layer is not told where its prompt ends
    assert layer.positions[0, 0].tolist() == list(range(4)) + list(range(79, 100))
    layer.update(keys[:, :, 100:], keys[:, :, 100:])
    assert layer.stored == 25 + 10


@pytest.mark.parametrize("kwargs", [dict(), dict(budget=4, compression_ratio=0.5), dict(budget=4), dict(sink_size=-1, budget=9)])
def test_bad_parameters(kwargs):
    with pytest.raises(kvtrim.KvtrimError):
        kvtrim.StreamingLLM(**kwargs)
