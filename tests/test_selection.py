"""`top_indices`, the shared top-k with ties to the earlier entry, against a stable sort."""

from __future__ import annotations

import pytest
import torch

from kvtrim.methods.base import top_indices


def stable_sort_top(scores, k):
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values


@pytest.mark.parametrize("n", [1, 7, 300, 1023, 1024, 1500])  # both the sort and the threshold path
@pytest.mark.parametrize("levels", [3, 0])  # 3 = heavy ties, 0 = continuous scores
def test_top_indices_equals_a_stable_sort(n, levels):
    g = torch.Generator().manual_seed(n)
    for k in sorted({1, n // 2, max(1, n - 1), n, n + 5} - {0}):
        scores = torch.randint(0, levels, (2, 3, n), generator=g).float() if levels else torch.randn(2, 3, n, generator=g)
        scores[0, 0, : min(4, n)] = float("inf")  # always-keep entries, as sinks get
        got = top_indices(scores, k)
        assert got.shape == (2, 3, min(k, n))
        assert torch.equal(got, stable_sort_top(scores, min(k, n)))
