"""Passkey retrieval at ~1.8k tokens on the real default model: does eviction keep the needle?"""

from __future__ import annotations

import pytest

import kvtrim
from kvtrim.passkey import make_passkey

pytestmark = pytest.mark.integration

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
KEYS = ("48213", "90576", "31847", "76092", "15538")


@pytest.fixture(scope="module")
def samples(smollm):
    _, tok = smollm
    return [make_passkey(tok, 1800, depth, key) for depth, key in zip(DEPTHS, KEYS)]


def retrieved(smollm, samples, method) -> tuple[list[bool], kvtrim.CacheStats]:
    model, tok = smollm
    hits = []
    for s in samples:
        ids = tok(s.prompt, return_tensors="pt").input_ids
        new, cache = kvtrim.generate(model, ids, method, max_new_tokens=8)
        hits.append(s.key in tok.decode(new[0]))
    return hits, cache.stats()


LAGKV = kvtrim.LagKV(sink_size=16, lag_size=64, keep_ratio=0.25)


def test_full_cache_retrieves(smollm, samples):
    hits, stats = retrieved(smollm, samples, kvtrim.FullCache())
    assert sum(hits) >= 4, hits
    assert stats.compression_ratio == 0


def test_lagkv_keeps_most_needles_and_streaming_at_the_same_size_loses_mid_context(smollm, samples):
    n = samples[0].n_tokens
    lag_hits, lag_stats = retrieved(smollm, samples, LAGKV)
    assert sum(lag_hits) >= 4, lag_hits
    assert lag_stats.compression_ratio > 0.65  # ~3.3x fewer entries

    budget = kvtrim.lagkv_stored_length(n, 16, 64, 0.25)
    stream_hits, stream_stats = retrieved(smollm, samples, kvtrim.StreamingLLM(sink_size=4, budget=budget))
    assert abs(max(stream_stats.stored_per_layer) - max(lag_stats.stored_per_layer)) <= 16
    mid = [hit for hit, depth in zip(stream_hits, DEPTHS) if depth <= 0.5]
    assert not any(mid), stream_hits  # needles outside the recent window are gone
