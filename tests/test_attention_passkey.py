"""Passkey at ~1.8k tokens on the real default model: SnapKV and H2O at the size LagKV(16, 64, 0.25) keeps.

Measured (SmolLM2-135M-Instruct, float32, raw prompt, `passkey_samples(tok, 1800, 5, seed=1)`, depths
0, .25, .5, .75, 1; 547 entries per KV head = LagKV's stored length for 1797 tokens): full cache 5/5,
LagKV 5/5, SnapKV 5/5, TOVA 5/5, H2O 1/5 (only the needle at depth 1, inside its recent half). H2O's
accumulated attention favours early tokens (every later query adds to them), so a mid-context needle that
only the final question attends to is outscored - the known weakness of accumulated scores on retrieval.
"""

from __future__ import annotations

import pytest

import kvtrim
from kvtrim.passkey import passkey_samples
from kvtrim.generate import generate

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def samples(smollm):
    _, tok = smollm
    return passkey_samples(tok, 1800, 5, seed=1)


def retrieved(smollm, samples, method):
    model, tok = smollm
    hits = []
    for s in samples:
        new, cache = generate(model, tok(s.prompt, return_tensors="pt").input_ids, method, max_new_tokens=8)
        hits.append(s.key in tok.decode(new[0], skip_special_tokens=True))
    return hits, cache.stats()


def test_snapkv_retrieves_and_h2o_loses_mid_context_needles_at_lagkv_size(smollm, samples):
    budget = kvtrim.lagkv_stored_length(samples[0].n_tokens, 16, 64, 0.25)
    assert 500 < budget < 600  # about 3.3x fewer entries than the prompt

    snap_hits, snap_stats = retrieved(smollm, samples, kvtrim.SnapKV(budget=budget))
    assert sum(snap_hits) >= 4, snap_hits
    assert max(snap_stats.stored_per_layer) <= budget + 8  # the budget plus the decoded tokens

    h2o_hits, h2o_stats = retrieved(smollm, samples, kvtrim.H2O(budget=budget))
    assert h2o_stats.stored_per_layer == [budget] * len(h2o_stats.stored_per_layer)  # one in, one out
    assert h2o_hits[-1], h2o_hits  # a needle right before the question sits in the recent half
    assert sum(h2o_hits[:-1]) <= 1, h2o_hits  # elsewhere the accumulated scores lose it
