"""KeyDiff: scores and kept sets against a slow loop reference; the timing rule; modes; passkey."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrim import KeyDiff, KvtrimError, TrimCache, lagkv_stored_length, make_method
from kvtrim.cache import TrimLayer
from kvtrim.methods.keydiff import keydiff_keep, keydiff_scores

SHAPES = [(1, 2, 37, 16), (2, 3, 50, 8), (1, 1, 5, 64), (2, 4, 129, 32)]  # (batch, kv_heads, n, head_dim)


# ---- slow, obviously-correct reference ------------------------------------------------------------
def ref_scores_head(keys: torch.Tensor) -> list[float]:
    """-cos(k_i, mean of normalised keys) for one head, `keys` (n, d), with python loops in float64."""
    keys = keys.double()
    n, d = keys.shape
    unit = [keys[i] / math.sqrt(sum(float(x) ** 2 for x in keys[i])) for i in range(n)]
    anchor = [sum(float(unit[i][c]) for i in range(n)) / n for c in range(d)]
    anchor_norm = math.sqrt(sum(a * a for a in anchor))
    scores = []
    for i in range(n):
        k = [float(x) for x in keys[i]]
        k_norm = math.sqrt(sum(x * x for x in k))
        scores.append(-sum(x * a for x, a in zip(k, anchor)) / (k_norm * anchor_norm))
    return scores


def ref_keep_head(keys: torch.Tensor, n_keep: int, sink: int = 0, recent: int = 0) -> list[int]:
    """Indices kept for one head: protected first, then highest score, ties to the older entry."""
    n = keys.shape[0]
    scores = ref_scores_head(keys)
    protected = lambda i: i < sink or i >= n - recent  # noqa: E731
    order = sorted(range(n), key=lambda i: (not protected(i), -scores[i], i))
    return sorted(order[:n_keep])


def ref_replay(keys: torch.Tensor, arrivals: list[int], budget: int, block: int, sink: int = 0, recent: int = 0):
    """Replay KeyDiff's timing rule entry by entry for every (batch, head). Returns, after each arrival,
    the kept positions `[b][h] -> list` (a multi-token arrival evicts once the cache exceeds `budget`;
    a single token evicts once it reaches `budget + block`)."""
    b, h = keys.shape[:2]
    kept = [[[] for _ in range(h)] for _ in range(b)]
    history, seen = [], 0
    for n_new in arrivals:
        for bi in range(b):
            for hi in range(h):
                cand = kept[bi][hi] + list(range(seen, seen + n_new))
                limit = budget if n_new > 1 else budget + block - 1
                if len(cand) > limit:
                    local = ref_keep_head(keys[bi, hi, cand], budget, sink, recent)
                    cand = [cand[i] for i in local]
                kept[bi][hi] = cand
        seen += n_new
        history.append([[list(p) for p in row] for row in kept])
    return history


def feed(method: KeyDiff, keys: torch.Tensor, arrivals: list[int]):
    """Feed `keys` to one TrimLayer in `arrivals` chunks; yield (layer, stored after) per update."""
    layer = TrimLayer(method, 0)
    values = keys * 2 + 1
    start = 0
    for n_new in arrivals:
        layer.update(keys[:, :, start : start + n_new], values[:, :, start : start + n_new])
        start += n_new
        yield layer


# ---- pure functions ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_scores_and_keep_match_loop_reference(shape):
    torch.manual_seed(sum(shape))
    keys = torch.randn(shape)
    scores = keydiff_scores(keys)
    assert scores.dtype == torch.float32 and scores.shape == shape[:3]
    n_keep = max(1, shape[2] // 3)
    keep = keydiff_keep(keys, n_keep)
    for b in range(shape[0]):
        for h in range(shape[1]):
            ref = torch.tensor(ref_scores_head(keys[b, h]), dtype=torch.float64)
            torch.testing.assert_close(scores[b, h].double(), ref, atol=1e-5, rtol=0)
            assert keep[b, h].tolist() == ref_keep_head(keys[b, h], n_keep)


def test_scores_are_float32_for_half_keys_and_scale_free():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 20, 16)
    assert keydiff_scores(keys.bfloat16()).dtype == torch.float32
    scaled = keys * torch.rand(1, 2, 20, 1) * 100  # cosine ignores each key's length
    torch.testing.assert_close(keydiff_scores(scaled), keydiff_scores(keys), atol=1e-5, rtol=0)


def test_ties_go_to_the_older_entry():
    same = torch.ones(1, 1, 10, 8)
    assert keydiff_keep(same, 4)[0, 0].tolist() == [0, 1, 2, 3]
    torch.manual_seed(3)
    keys = torch.randn(1, 1, 12, 8)
    keys[0, 0, 9] = keys[0, 0, 4]  # an exact duplicate: equal scores
    rank = keydiff_scores(keys)[0, 0].argsort(descending=True).tolist()
    n_keep = min(rank.index(4), rank.index(9)) + 1  # the boundary falls between the twins
    kept = keydiff_keep(keys, n_keep)[0, 0].tolist()
    assert 4 in kept and 9 not in kept
    assert kept == ref_keep_head(keys[0, 0], n_keep)


def test_keep_returns_none_when_everything_fits_and_protects_sinks_and_recent():
    keys = torch.randn(2, 2, 9, 4)
    assert keydiff_keep(keys, 9) is None
    keep = keydiff_keep(keys, 6, sink_size=2, recent_size=3)
    for b in range(2):
        for h in range(2):
            row = keep[b, h].tolist()
            assert {0, 1, 6, 7, 8} <= set(row) and row == sorted(row)
            assert row == ref_keep_head(keys[b, h], 6, sink=2, recent=3)


# ---- the timing rule inside a cache layer -----------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 2, 16), (2, 3, 8), (1, 1, 32)])  # (batch, kv_heads, head_dim)
def test_blockwise_replay_matches_reference(shape):
    b, h, d = shape
    torch.manual_seed(h * d)
    budget, block = 20, 8
    arrivals = [8] * 9 + [5, 3, 7]  # full blocks, then shorter blocks (a final partial block)
    keys = torch.randn(b, h, sum(arrivals), d)
    ref = ref_replay(keys, arrivals, budget, block)
    for step, layer in enumerate(feed(KeyDiff(budget=budget, block_size=block), keys, arrivals)):
        assert layer.positions.tolist() == ref[step], f"after arrival {step}"
        assert layer.stored <= budget
        # keys and values follow the positions (gathered together)
        assert torch.equal(layer.keys, keys.gather(2, layer.positions[..., None].expand(-1, -1, -1, d)))
        assert torch.equal(layer.values, layer.keys * 2 + 1)
    assert layer.peak <= budget + block


def test_stored_never_exceeds_budget_plus_block_and_decode_cadence():
    torch.manual_seed(1)
    budget, block = 12, 5
    arrivals = [5] * 6 + [1] * 23  # block-wise prefill of 30 tokens, then 23 decode steps
    keys = torch.randn(1, 2, sum(arrivals), 8)
    ref = ref_replay(keys, arrivals, budget, block)
    stored = []
    for step, layer in enumerate(feed(KeyDiff(budget=budget, block_size=block), keys, arrivals)):
        assert layer.positions.tolist() == ref[step]
        assert layer.peak <= budget + block
        stored.append(layer.stored)
    prefill = stored[:6]
    assert prefill == [5, 10, 12, 12, 12, 12]  # a block evicts as soon as the cache exceeds the budget
    decode = stored[6:]
    # grow by one per token; the token that brings the cache to budget + block evicts back to budget
    assert decode == [13, 14, 15, 16, 12] * 4 + [13, 14, 15]
    assert layer.peak == budget + block


def test_one_shot_prefill_evicts_to_budget_then_decodes_in_blocks():
    torch.manual_seed(2)
    keys = torch.randn(1, 2, 70, 8)
    arrivals = [60] + [1] * 10
    ref = ref_replay(keys, arrivals, 16, 4)
    for step, layer in enumerate(feed(KeyDiff(budget=16, block_size=4), keys, arrivals)):
        assert layer.positions.tolist() == ref[step]
    assert layer.peak == 60  # one-shot: attend to everything, then evict (memory is not bounded)


def test_sinks_and_recent_window_in_blockwise_mode():
    torch.manual_seed(4)
    budget, block, sink, recent = 10, 4, 2, 3
    arrivals = [4] * 8 + [1] * 7
    keys = torch.randn(2, 2, sum(arrivals), 8)
    ref = ref_replay(keys, arrivals, budget, block, sink, recent)
    method = KeyDiff(budget=budget, block_size=block, sink_size=sink, recent_size=recent)
    for step, layer in enumerate(feed(method, keys, arrivals)):
        assert layer.positions.tolist() == ref[step]
        if layer.evictions:
            pos = layer.positions[0, 0].tolist()
            assert pos[:2] == [0, 1]
    assert layer.positions[..., -1].eq(sum(arrivals) - 1).all()


def test_ratio_mode_is_one_shot():
    torch.manual_seed(5)
    keys = torch.randn(1, 2, 47, 8)
    arrivals = [40] + [1] * 7
    method = KeyDiff(compression_ratio=0.75)
    stored = [layer.stored for layer in feed(method, keys, arrivals)]
    # a standalone layer learns that its prompt ended at the first decode step: it compresses the 40
    # prompt entries to int(40 * 0.25) = 10 there, before appending; no further eviction
    assert stored == [40] + list(range(11, 18))
    layer = next(feed(method, keys, [40]))
    layer.end_prompt()
    assert layer.positions[0].tolist() == [ref_keep_head(keys[0, h, :40], 10) for h in range(2)]
    # a chunked prompt is compressed once, when it ends, to the same set as a one-shot prompt
    chunked = list(feed(method, keys, [20, 20]))[-1]
    chunked.end_prompt()
    assert torch.equal(chunked.positions, layer.positions)
    # appends after the prompt (a question, a new turn) are kept
    for after in (feed(method, keys, [40, 1, 6]),):
        last = list(after)[-1]
        assert last.stored == 10 + 1 + 6


def test_validation_errors_are_one_liners():
    with pytest.raises(KvtrimError, match="exactly one"):
        KeyDiff()
    with pytest.raises(KvtrimError, match="exactly one"):
        KeyDiff(budget=10, compression_ratio=0.5)
    with pytest.raises(KvtrimError, match="must not exceed"):
        KeyDiff(budget=4, sink_size=3, recent_size=2)
    with pytest.raises(KvtrimError, match="block_size"):
        KeyDiff(budget=4, block_size=0)
    with pytest.raises(KvtrimError, match="budget"):
        KeyDiff(budget=0)
    with pytest.raises(KvtrimError, match="compression_ratio"):
        KeyDiff(compression_ratio=1.0)


def test_registry_cli_and_at_budget():
    from kvtrim.cli import build_parser, method_from_args

    assert make_method("keydiff", budget=256, block_size=128) == KeyDiff(budget=256, block_size=128)
    args = build_parser().parse_args(["generate", "--method", "keydiff", "--budget", "256", "--block-size", "128"])
    assert method_from_args(args) == KeyDiff(budget=256, block_size=128)
    assert KeyDiff.at_budget(300, 2000, block_size=64) == KeyDiff(budget=300, block_size=64)


def test_tiny_model_generate_frees_memory_and_keeps_positions(tiny):
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 90))
    cache = TrimCache(KeyDiff(budget=24, block_size=16), config=tiny.config)
    tiny.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, prefill_chunk_size=16, max_new_tokens=20,
                  do_sample=False, pad_token_id=0)
    stats = cache.stats()
    assert stats.tokens_seen == 90 + 19  # the last generated token is not fed back
    assert all(p <= 24 + 16 for p in stats.peak_per_layer)
    assert all(24 <= s < 24 + 16 for s in stats.stored_per_layer)
    assert stats.bytes_stored < stats.bytes_full / 2
    for layer in cache.layers:
        pos = layer.positions
        assert (pos.diff(dim=-1) > 0).all() and pos.max() < stats.tokens_seen


# ---- integration: passkey at the stored size of a LagKV setting ------------------------------------------
@pytest.mark.integration
def test_blockwise_keydiff_keeps_early_and_mid_needles_at_lagkv_size(smollm):
    """Block-wise KeyDiff (block 128, kvtrim's generate default) holding what LagKV(16, 64, 0.25) keeps.

    Measured (SmolLM2-135M-Instruct, float32, raw prompts of ~1.8k tokens, passkey_samples(seed=1),
    depths 0/0.25/0.5/0.75/1, budget ~547 = 3.3x fewer entries): full cache 5/5; KeyDiff one-shot
    prefill 5/5; KeyDiff block-wise 4/5 (misses depth 1.0); LagKV one-shot 4/5 (misses 0.5); LagKV
    chunk-by-chunk 3/5; StreamingLLM at the same size 2/5 (loses depths 0, 0.25 and 0.5).
    Asserted: block-wise KeyDiff retrieves every needle at depth <= 0.5 (the ones positional eviction
    loses) and at least 3 of 5 overall, while its prefill never holds more than budget + block.
    """
    from kvtrim.passkey import passkey_samples
    from kvtrim.generate import generate

    model, tok = smollm
    hits = {}
    for sample in passkey_samples(tok, 1800, 5, seed=1):
        ids = tok(sample.prompt, return_tensors="pt").input_ids
        budget = lagkv_stored_length(ids.shape[-1], 16, 64, 0.25)
        new, cache = generate(model, ids, KeyDiff(budget=budget, block_size=128), max_new_tokens=8)
        hits[sample.depth] = sample.key in tok.decode(new[0])
        stats = cache.stats()
        assert max(stats.peak_per_layer) <= budget + 128
        assert stats.compression_ratio > 0.65
    assert all(hit for depth, hit in hits.items() if depth <= 0.5), hits
    assert sum(hits.values()) >= 3, hits
