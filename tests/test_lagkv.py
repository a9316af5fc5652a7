"""LagKV against a slow, loop-based reference written from the paper / official code."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

import kvtrim
from kvtrim.cache import TrimLayer
from kvtrim.methods.lagkv import lag_relative_scores, lagkv_select_global


# ---- slow references ------------------------------------------------------------------------------
def ref_token_scores(part: list[list[float]], nxt: list[list[float]], eps: float) -> list[float]:
    """Softmax over the partition of the per-token channel std of the min-max normalised partition."""
    d = len(part[0])
    lo = [min(row[c] for row in nxt) for c in range(d)]
    hi = [max(row[c] for row in nxt) for c in range(d)]
    spread = [statistics.stdev([(row[c] - lo[c]) / max(hi[c] - lo[c], eps) for c in range(d)]) for row in part]
    top = max(spread)
    exps = [math.exp(s - top) for s in spread]
    return [e / sum(exps) for e in exps]


def ref_partition_scores(keys, values, start: int, lag: int, w: float, eps: float) -> list[float]:
    """keys/values: lists of rows (one head). Scores of partition [start, start+lag) against the next."""
    part_k, next_k = keys[start : start + lag], keys[start + lag : start + 2 * lag]
    part_v, next_v = values[start : start + lag], values[start + lag : start + 2 * lag]
    sk = ref_token_scores(part_k, next_k, eps)
    sv = ref_token_scores(part_v, next_v, eps)
    return [a + w * b for a, b in zip(sk, sv)]


def ref_lagkv_reference_mode(keys, values, sink, lag, keep_ratio, w=1.0, eps=1e-6, arrivals=None) -> list[int]:
    """The official incremental rule, one partition at a time, for one head. Returns kept positions."""
    n = len(keys)
    k = math.floor(keep_ratio * lag)
    arrivals = arrivals or [n]
    stored: list[int] = []  # original positions
    compressed = 0
    pos = 0
    for size in arrivals:
        stored.extend(range(pos, pos + size))
        pos += size
        while len(stored) - (sink + compressed) >= 2 * lag:
            base = sink + compressed
            rows_k = [keys[p] for p in stored]
            rows_v = [values[p] for p in stored]
            scores = ref_partition_scores(rows_k, rows_v, base, lag, w, eps)
            best = sorted(range(lag), key=lambda i: -scores[i])[:k]
            kept = [stored[base + i] for i in sorted(best)]
            stored = stored[:base] + kept + stored[base + lag :]
            compressed += k
    return stored


def ref_lagkv_global(keys, values, sink, lag, compression_ratio, w=1.0, eps=1e-6) -> list[int]:
    """kvpress-style: rank within partition / lag, sinks and window always kept, one top-k; ties -> earlier."""
    n = len(keys)
    n_keep = int(n * (1 - compression_ratio))
    parts = (n - sink) // lag
    score = [2.0] * n
    for j in range(parts - 1):
        start = sink + j * lag
        s = ref_partition_scores(keys, values, start, lag, w, eps)
        for i in range(lag):
            score[start + i] = sum(1 for x in s if x < s[i]) / lag
    order = sorted(range(n), key=lambda i: (-score[i], i))
    return sorted(order[:n_keep])


def random_kv(b, h, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)


def feed(method, keys, values, arrivals) -> TrimLayer:
    """Push fixed K/V into one evicting layer in the given arrival sizes."""
    layer = TrimLayer(method, layer_idx=0)
    pos = 0
    for size in arrivals:
        layer.update(keys[:, :, pos : pos + size], values[:, :, pos : pos + size])
        pos += size
    return layer


SHAPES = [(1, 1, 4), (1, 3, 8), (2, 2, 16)]  # (batch, kv_heads, head_dim)


# ---- scoring and selection vs reference -------------------------------------------------------------
@pytest.mark.parametrize("b,h,d", SHAPES)
def test_scores_match_reference(b, h, d):
    lag = 8
    keys, values = random_kv(b, h, 4 * lag, d)
    got = lag_relative_scores(keys, values, lag, value_weight=0.7)
    assert got.shape == (b, h, 3, lag)
    for bi in range(b):
        for hi in range(h):
            k, v = keys[bi, hi].tolist(), values[bi, hi].tolist()
            for j in range(3):
                want = ref_partition_scores(k, v, j * lag, lag, 0.7, 1e-6)
                assert got[bi, hi, j].tolist() == pytest.approx(want, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("b,h,d", SHAPES)
@pytest.mark.parametrize("sink,lag,keep_ratio,n", [(4, 8, 0.25, 83), (0, 8, 0.5, 64), (2, 5, 0.4, 61), (16, 8, 1 / 8, 40)])
def test_reference_mode_selection_matches_loop_reference(b, h, d, sink, lag, keep_ratio, n):
    keys, values = random_kv(b, h, n, d, seed=n)
    layer = feed(kvtrim.LagKV(sink_size=sink, lag_size=lag, keep_ratio=keep_ratio), keys, values, [n])
    for bi in range(b):
        for hi in range(h):
            want = ref_lagkv_reference_mode(keys[bi, hi].tolist(), values[bi, hi].tolist(), sink, lag, keep_ratio)
            assert layer.positions[bi, hi].tolist() == want
            # stored tensors are the original entries at those positions
            assert torch.equal(layer.keys[bi, hi], keys[bi, hi, want])
            assert torch.equal(layer.values[bi, hi], values[bi, hi, want])


@pytest.mark.parametrize("b,h,d", SHAPES)
@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8])
def test_global_mode_matches_loop_reference(b, h, d, ratio):
    sink, lag, n = 4, 8, 77
    keys, values = random_kv(b, h, n, d, seed=7)
    keep = lagkv_select_global(keys, values, sink, lag, ratio)
    assert keep.shape == (b, h, int(n * (1 - ratio)))
    for bi in range(b):
        for hi in range(h):
            want = ref_lagkv_global(keys[bi, hi].tolist(), values[bi, hi].tolist(), sink, lag, ratio)
            assert keep[bi, hi].tolist() == want


def test_global_mode_acts_once_after_first_forward():
    keys, values = random_kv(1, 2, 120, 8)
    method = kvtrim.LagKV(sink_size=4, lag_size=8, compression_ratio=0.5)
    layer = feed(method, keys, values, [100])
    layer.end_prompt()  # a standalone layer is not told where its prompt ends
    layer.update(keys[:, :, 100:], values[:, :, 100:])
    assert layer.stored == 50 + 20  # the prefill was halved; the next forward only appended
    assert layer.evictions == 1


# ---- arrival invariance, lengths, no NaN ---------------------------------------------------------------
@pytest.mark.parametrize("sink,lag,keep_ratio", [(4, 8, 0.25), (3, 6, 0.5), (0, 4, 0.75)])
def test_one_shot_chunked_and_token_by_token_select_the_same(sink, lag, keep_ratio):
    n = 150
    keys, values = random_kv(2, 3, n, 8, seed=3)
    method = kvtrim.LagKV(sink_size=sink, lag_size=lag, keep_ratio=keep_ratio)
    one_shot = feed(method, keys, values, [n]).positions
    chunked = feed(method, keys, values, [37, 1, 50, 13, 49]).positions
    by_token = feed(method, keys, values, [1] * n).positions
    assert torch.equal(one_shot, chunked)
    assert torch.equal(one_shot, by_token)


@pytest.mark.parametrize("sink,lag,keep_ratio", [(16, 64, 0.25), (4, 8, 0.5), (0, 10, 0.3), (5, 7, 1 / 7)])
def test_stored_length_follows_the_paper_formula_at_every_step(sink, lag, keep_ratio):
    n = sink + 6 * lag + 3
    keys, values = random_kv(1, 2, n, 4)
    layer = TrimLayer(kvtrim.LagKV(sink_size=sink, lag_size=lag, keep_ratio=keep_ratio), 0)
    for t in range(n):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        seen = t + 1
        expected = seen if seen < sink + 2 * lag else (
            sink + math.floor(keep_ratio * lag) * ((seen - sink) // lag - 1) + lag + (seen - sink) % lag
        )
        assert layer.stored == expected == kvtrim.lagkv_stored_length(seen, sink, lag, keep_ratio)
        assert layer.get_seq_length() == seen


def test_zero_range_channel_gives_no_nan():
    keys, values = random_kv(1, 2, 64, 8)
    keys[..., 3] = 1.5  # a constant channel: zero min-max range everywhere
    values[..., :] = 0.25  # every value channel constant
    scores = lag_relative_scores(keys, values, 8)
    assert torch.isfinite(scores).all()
    layer = feed(kvtrim.LagKV(sink_size=4, lag_size=8, keep_ratio=0.25), keys, values, [64])
    assert torch.isfinite(layer.keys).all()
    pos = layer.positions
    assert (pos.diff(dim=-1) > 0).all()  # a valid, strictly increasing selection


def test_keep_ratio_one_keeps_everything_and_skip_layers_are_untouched():
    keys, values = random_kv(1, 2, 90, 8)
    assert feed(kvtrim.LagKV(sink_size=4, lag_size=8, keep_ratio=1.0), keys, values, [90]).stored == 90
    skipped = TrimLayer(kvtrim.LagKV(sink_size=4, lag_size=8, keep_ratio=0.25, skip_layers=(3,)), layer_idx=3)
    skipped.update(keys, values)
    assert skipped.stored == 90


# ---- Eq. 12-13 helper ---------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [300, 1795, 4096, 16384])
@pytest.mark.parametrize("target", [0.25, 0.5, 0.75, 0.875])
@pytest.mark.parametrize("sink,lag", [(16, 128), (4, 64), (16, 64)])
def test_keep_ratio_for_is_the_largest_ratio_reaching_the_target(length, target, sink, lag):
    try:
        r = kvtrim.lagkv_keep_ratio_for(target, length, sink, lag)
    except kvtrim.KvtrimError:
        # out of reach: even one token per partition keeps too much (or too short to compress)
        if length < sink + 2 * lag:
            return
        assert 1 - kvtrim.lagkv_stored_length(length, sink, lag, 1 / lag) / length < target
        return
    assert 1 - kvtrim.lagkv_stored_length(length, sink, lag, r) / length >= target - 1e-9
    if r < 1:
        assert 1 - kvtrim.lagkv_stored_length(length, sink, lag, r + 1 / lag) / length < target


def test_paper_example_16k():
    # lagkv.md §1.3: L_s=16384, S=16, L=128, r=0.25 -> L_R=4288, C=0.738
    assert kvtrim.lagkv_stored_length(16384, 16, 128, 0.25) == 4288


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(keep_ratio=0.0), "keep_ratio must be in (0, 1]"),
        (dict(keep_ratio=1.5), "keep_ratio must be in (0, 1]"),
        (dict(lag_size=0), "lag_size must be >= 1"),
        (dict(sink_size=-1), "sink_size must be >= 0"),
        (dict(keep_ratio=0.1, lag_size=4), "at least one token"),
        (dict(keep_ratio=0.5, compression_ratio=0.5), "not both"),
        (dict(compression_ratio=1.0), "compression_ratio must be in [0, 1)"),
    ],
)
def test_bad_parameters_fail_early_with_one_line(kwargs, fragment):
    with pytest.raises(kvtrim.KvtrimError) as err:
        kvtrim.LagKV(**kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)
