"""Chunked / block-wise prefill: exactness without eviction, masks and positions with eviction
(against a hand-built reference with explicit masks), the generate() path, LagKV chunk-by-chunk."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from kvtrim import FullCache, KeyDiff, KvtrimError, LagKV, TrimCache, lagkv_stored_length
from kvtrim.generate import generate
from kvtrim.prefill import lagkv_chunk_sizes, prefill, prefill_lagkv


def prompt(n: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)


# ---- no eviction: chunked == one shot ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_with_full_cache_equals_one_shot(tiny, chunk):
    ids = prompt(100 if chunk > 1 else 30, batch=2)
    one = TrimCache(FullCache(), config=tiny.config)
    logits_one = prefill(tiny, ids, one)
    many = TrimCache(FullCache(), config=tiny.config)
    logits_many = prefill(tiny, ids, many, chunk_size=chunk)
    assert logits_many.shape == (2, tiny.config.vocab_size)
    torch.testing.assert_close(logits_many, logits_one, atol=1e-5, rtol=1e-5)
    full = tiny(ids).logits[:, -1]  # and both equal a plain forward without a cache
    torch.testing.assert_close(logits_one, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(one.layers, many.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=1e-5)
        assert torch.equal(b.positions, torch.arange(ids.shape[-1]).expand_as(b.positions))
        assert b.seen == ids.shape[-1]


def test_prefill_continues_an_existing_cache(tiny):
    ids = prompt(100)
    whole = TrimCache(FullCache(), config=tiny.config)
    expected = prefill(tiny, ids, whole, chunk_size=30)
    parts = TrimCache(FullCache(), config=tiny.config)
    prefill(tiny, ids[:, :45], parts, chunk_size=30)
    got = prefill(tiny, ids[:, 45:], parts, chunk_size=30)  # positions continue at 45
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(parts.layers[0].positions, whole.layers[0].positions)


# ---- eviction inside the prefill: a hand-built reference -----------------------------------------------
def ref_keep(keys: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Loop reference of KeyDiff's selection on `(batch, kv_heads, n, d)`: indices `(b, h, n_keep)`."""
    b, h, n, _ = keys.shape
    out = torch.empty(b, h, n_keep, dtype=torch.long)
    for bi in range(b):
        for hi in range(h):
            k = keys[bi, hi].double()
            unit = torch.stack([k[i] / k[i].norm() for i in range(n)])
            anchor = sum(unit[i] for i in range(n)) / n
            cos = [float(k[i] @ anchor / (k[i].norm() * anchor.norm())) for i in range(n)]
            order = sorted(range(n), key=lambda i: (cos[i], i))  # lowest cosine first, ties to older
            out[bi, hi] = torch.tensor(sorted(order[:n_keep]))
    return out


def reference_blockwise(model, ids: torch.Tensor, budget: int, block: int):
    """Block-wise prefill without TrimCache: a fresh DynamicCache per block holding only the retained
    entries, an explicit 4-D mask (all retained visible, causal inside the block), true positions."""
    b, n = ids.shape
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per layer: keys, values, positions
    for start in range(0, n, block):
        blk = ids[:, start : start + block]
        q = blk.shape[-1]
        cache = DynamicCache(config=model.config)
        for li, (k, v, _) in enumerate(kept):
            cache.update(k, v, li)
        n_ret = kept[0][0].shape[-2] if kept else 0
        mask = torch.ones(q, n_ret + q, dtype=torch.bool)
        mask[:, n_ret:] = torch.ones(q, q, dtype=torch.bool).tril()
        positions = torch.arange(start, start + q).expand(b, q)
        with torch.no_grad():
            out = model(input_ids=blk, cache=cache, position_ids=positions,
                        attention_mask=mask.expand(b, 1, q, n_ret + q), use_cache=True)
        new_kept = []
        for li in range(len(cache.layers)):
            k, v = cache.layers[li].keys, cache.layers[li].values
            h = k.shape[1]
            pos = torch.cat([kept[li][2] if kept else torch.empty(b, h, 0, dtype=torch.long),
                             torch.arange(start, start + q).expand(b, h, q)], dim=-1)
            # KeyDiff's timing rule: every prompt block evicts once over budget (kvtrim.prefill declares
            # its blocks, so a final 1-token block is a prompt block too)
            if k.shape[-2] > budget:
                keep = ref_keep(k, budget)
                idx = keep[..., None].expand(-1, -1, -1, k.shape[-1])
                k, v, pos = k.gather(2, idx), v.gather(2, idx), pos.gather(2, keep)
            new_kept.append((k, v, pos))
        kept = new_kept
    return out.logits[:, -1], kept


@pytest.mark.parametrize("block", [16, 11])
def test_keydiff_blockwise_prefill_matches_hand_built_reference(tiny, block):
    ids = prompt(100, seed=1)
    budget = 24
    cache = TrimCache(KeyDiff(budget=budget, block_size=block), config=tiny.config)
    logits = prefill(tiny, ids, cache)  # default chunk = the method's block size
    ref_logits, ref_kept = reference_blockwise(tiny, ids, budget, block)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    for layer, (k, v, pos) in zip(cache.layers, ref_kept):
        assert torch.equal(layer.positions, pos)
        torch.testing.assert_close(layer.keys, k, atol=1e-4, rtol=1e-4)
        assert layer.peak <= budget + block and layer.seen == 100
        assert layer.stored == budget


def test_generate_prefill_chunk_size_equals_kvtrim_prefill(tiny):
    ids = prompt(120, seed=2)
    method = KeyDiff(budget=30, block_size=16)
    mine = TrimCache(method, config=tiny.config)
    logits = prefill(tiny, ids, mine)
    theirs = TrimCache(method, config=tiny.config)
    out = tiny.generate(ids, cache=theirs, prefill_chunk_size=16, max_new_tokens=1, do_sample=False,
                        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                        attention_mask=torch.ones_like(ids))
    torch.testing.assert_close(out.logits[0], logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(mine.layers, theirs.layers):
        assert torch.equal(a.positions, b.positions)
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        assert a.peak == b.peak <= 30 + 16


def test_decoding_after_blockwise_prefill_uses_true_positions(tiny):
    """Stock generate (chunked prefill, then decode) vs a hand-driven greedy loop with explicit positions."""
    ids = prompt(80, seed=3)
    tiny.generation_config.eos_token_id = None  # decode all 25 tokens
    method = KeyDiff(budget=20, block_size=8)
    cache = TrimCache(method, config=tiny.config)
    new = tiny.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, prefill_chunk_size=8,
                        max_new_tokens=25, do_sample=False, pad_token_id=0)
    hand = TrimCache(method, config=tiny.config)
    logits = prefill(tiny, ids, hand)
    tokens = []
    with torch.no_grad():
        for t in range(25):
            tok = logits.argmax(-1, keepdim=True)
            tokens.append(int(tok))
            if t < 24:
                pos = torch.tensor([[80 + t]])
                logits = tiny(input_ids=tok, cache=hand, position_ids=pos, logits_to_keep=1).logits[:, -1]
    assert new[0, 80:].tolist() == tokens
    assert torch.equal(cache.layers[1].positions, hand.layers[1].positions)


def test_kvtrim_generate_uses_the_block_size_by_default(tiny):
    ids = prompt(100, seed=4)
    _, cache = generate(tiny, ids, KeyDiff(budget=20, block_size=10), max_new_tokens=3, pad_token_id=0)
    assert max(cache.stats().peak_per_layer) <= 30
    _, one_shot = generate(tiny, ids, KeyDiff(budget=20, block_size=10), max_new_tokens=3,
                           prefill_chunk_size=None, pad_token_id=0)
    assert max(one_shot.stats().peak_per_layer) == 100


def test_default_chunk_size_and_errors(tiny):
    assert KeyDiff(budget=8, block_size=4).prefill_block_size() == 4
    assert KeyDiff(compression_ratio=0.5).prefill_block_size() is None
    assert LagKV().prefill_block_size() is None and FullCache().prefill_block_size() is None
    ids = prompt(20)
    cache = TrimCache(FullCache(), config=tiny.config)
    with pytest.raises(KvtrimError, match="add up to"):
        prefill(tiny, ids, cache, chunk_sizes=[10, 5])
    with pytest.raises(KvtrimError, match="not both"):
        prefill(tiny, ids, cache, chunk_size=5, chunk_sizes=[20])
    with pytest.raises(KvtrimError, match="TrimCache"):
        prefill(tiny, ids, DynamicCache(config=tiny.config))
    with pytest.raises(KvtrimError, match="LagKV"):
        prefill_lagkv(tiny, ids, TrimCache(KeyDiff(budget=8), config=tiny.config))
    with pytest.raises(KvtrimError, match="exceed the model's context"):
        prefill(tiny, prompt(tiny.config.max_position_embeddings + 1), cache)
    # ratio mode over a chunked prompt: kept whole until the prompt ends, then compressed once
    ratio = TrimCache(KeyDiff(compression_ratio=0.5), config=tiny.config)
    prefill(tiny, ids, ratio, chunk_size=8)
    assert all(layer.stored == 10 and layer.evictions == 1 and layer.peak == 20 for layer in ratio.layers)


# ---- LagKV chunk-by-chunk ---------------------------------------------------------------------------
def test_lagkv_chunk_sizes_follow_the_rule():
    assert lagkv_chunk_sizes(10, 4, 8) == [10]
    assert lagkv_chunk_sizes(20, 4, 8) == [20]
    assert lagkv_chunk_sizes(21, 4, 8) == [20, 1]
    assert lagkv_chunk_sizes(45, 4, 8) == [20, 8, 8, 8, 1]
    for n in range(1, 200, 7):
        sizes = lagkv_chunk_sizes(n, 16, 16)
        assert sum(sizes) == n and sizes[0] == min(n, 48) and all(s == 16 for s in sizes[1:-1])
        assert 1 <= sizes[-1] <= (48 if len(sizes) == 1 else 16)


@pytest.mark.parametrize("n", [37, 130, 141])
def test_lagkv_chunk_by_chunk_stored_length_and_peak(tiny, n):
    sink, lag, ratio = 4, 8, 0.25
    method = LagKV(sink_size=sink, lag_size=lag, keep_ratio=ratio)
    ids = prompt(n, seed=n)
    sizes = lagkv_chunk_sizes(n, sink, lag)
    # chunk by chunk, checking every layer after every chunk
    cache = TrimCache(method, config=tiny.config)
    seen, peak = 0, 0
    for size in sizes:
        peak = max(peak, lagkv_stored_length(seen, sink, lag, ratio) + size)
        prefill(tiny, ids[:, seen : seen + size], cache)
        seen += size
        for layer in cache.layers:
            assert layer.stored == lagkv_stored_length(seen, sink, lag, ratio)
            assert layer.seen == seen
    # prefill_lagkv runs the same schedule
    chunked = TrimCache(method, config=tiny.config)
    logits = prefill_lagkv(tiny, ids, chunked)
    for a, b in zip(cache.layers, chunked.layers):
        assert torch.equal(a.positions, b.positions)
        assert b.peak == peak  # the stored cache before the chunk plus the chunk
        assert b.peak <= sink + math.floor(ratio * lag) * (n - sink) / lag + 2 * lag
    # one shot stores the same count but peaks at n; its outputs differ once chunking evicted early
    one = TrimCache(method, config=tiny.config)
    logits_one = prefill(tiny, ids, one)
    assert [layer.stored for layer in one.layers] == [layer.stored for layer in chunked.layers]
    assert max(layer.peak for layer in one.layers) == n
    if len(sizes) > 2:
        assert peak < n
        assert not torch.allclose(logits, logits_one, atol=1e-4)


# ---- integration: the memory bound on a real 4k-token prompt ------------------------------------------
@pytest.mark.integration
def test_keydiff_blockwise_prefill_bounds_memory_on_4k_prompt(smollm):
    from kvtrim.passkey import passkey_samples

    model, tok = smollm
    sample = passkey_samples(tok, 4000, 1, seed=0)[0]
    ids = tok(sample.prompt, return_tensors="pt").input_ids
    budget, block = 256, 128
    spied: list[int] = []

    class Spy(KeyDiff):  # records the stored length of every layer at every update, before eviction
        def on_update(self, view):
            spied.append(view.stored)
            return super().on_update(view)

    cache = TrimCache(Spy(budget=budget, block_size=block), config=model.config)
    logits = prefill(model, ids, cache)
    n = ids.shape[-1]
    assert n > 3900 and torch.isfinite(logits).all()
    n_layers = model.config.num_hidden_layers
    assert len(spied) == n_layers * math.ceil(n / block)
    assert max(spied) == budget + block  # reached, never exceeded
    # kvtrim.prefill declares its blocks: even a final 1-token block is a prompt block (cut to budget)
    assert all(layer.peak <= budget + block and layer.stored == budget for layer in cache.layers)
    assert all(layer.seen == n for layer in cache.layers)


def test_unequal_layer_lengths_are_refused_before_a_wrong_mask(tiny):
    # LagKV with skip_layers stores more in the skipped layer; transformers sizes one mask for all layers
    cache = TrimCache(LagKV(sink_size=4, lag_size=8, keep_ratio=0.25, skip_layers=(0,)), config=tiny.config)
    with pytest.raises(KvtrimError, match="different numbers of entries"):
        prefill_lagkv(tiny, prompt(60), cache)
