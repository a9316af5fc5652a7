"""SnapKV: kept positions vs a loop reference, when it acts, and through a real (tiny) model."""

from __future__ import annotations

import pytest
import torch
from attention_reference import drive, rand_qkv, snapkv_reference
from conftest import tiny_model

import kvtrim
from kvtrim.methods.snapkv import snapkv_keep, snapkv_scores


@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("pooling,kernel", [("max", 7), ("avg", 5), ("max", 1)])
def test_kept_positions_match_loop_reference(hq, hkv, pooling, kernel):
    n, window, budget, scale = 40, 6, 17, 0.4
    q, k, v = rand_qkv(2, hq, hkv, n, seed=hq * 10 + kernel)
    expected = snapkv_reference(q, k, window, kernel, pooling, budget, scale)
    keep = snapkv_keep(snapkv_scores(q, k, window, kernel, pooling, scale), n, window, budget)
    assert keep.tolist() == expected
    # the same through a cache layer fed the prompt in one forward
    layer, _ = drive(kvtrim.SnapKV(window=window, kernel=kernel, pooling=pooling, budget=budget), q, k, v, n, scale)
    assert layer.positions.tolist() == expected
    assert torch.equal(layer.keys, k.gather(2, layer.positions[..., None].expand(-1, -1, -1, k.shape[-1])))


def test_short_prompt_is_left_alone_and_decode_never_evicts():
    q, k, v = rand_qkv(1, 4, 2, 50, seed=3)
    layer, history = drive(kvtrim.SnapKV(window=4, budget=30), q, k, v, 20, 0.3)  # 20 <= 30: nothing to do
    assert [h.shape[-1] for h in history] == list(range(20, 51))
    assert layer.evictions == 0
    layer, history = drive(kvtrim.SnapKV(window=4, budget=12), q, k, v, 20, 0.3)
    assert history[0].shape[-1] == 12  # cut once, after the prompt
    assert [h.shape[-1] for h in history[1:]] == list(range(13, 13 + 30))  # then only appends
    assert layer.evictions == 1


def test_compression_ratio_mode_acts_once_on_the_first_forward():
    q, k, v = rand_qkv(1, 4, 2, 60, seed=4)
    layer, history = drive(kvtrim.SnapKV(window=4, compression_ratio=0.75), q, k, v, 40, 0.3)
    assert history[0].shape[-1] == 10
    assert history[-1].shape[-1] == 30 and layer.evictions == 1


def test_generate_on_tiny_model_keeps_what_the_reference_keeps(tiny):
    """The queries handed over by kvtrim's attention are the model's post-RoPE queries: the cache keeps
    what the reference computes from queries and keys captured on a full-cache run."""
    model = kvtrim.enable(tiny)
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    captured = {}

    class Capture(kvtrim.FullCache):
        needs_queries = True

        def on_attention(self, view):
            captured[view.layer_idx] = (view.queries.clone(), view.keys.clone(), view.scaling)

    with torch.no_grad():
        model(ids, cache=kvtrim.TrimCache(Capture(), config=model.config))
        cache = kvtrim.TrimCache(kvtrim.SnapKV(window=8, kernel=5, budget=30), config=model.config)
        model(ids, cache=cache)
    for idx, layer in enumerate(cache.layers):
        qs, ks, scale = captured[idx]
        assert scale == pytest.approx(ks.shape[-1] ** -0.5)
        assert layer.positions.tolist() == snapkv_reference(qs, ks, 8, 5, "max", 30, scale)


def test_chunked_prefill_is_blockwise_snapkv(tiny):
    model = kvtrim.enable(tiny)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(2))
    cache = kvtrim.TrimCache(kvtrim.SnapKV(window=4, budget=24), config=model.config)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=5, do_sample=False,
                       prefill_chunk_size=30, pad_token_id=0)
    layer = cache.layers[0]
    assert layer.evictions == 3  # after each 30-token chunk (the first leaves 30 > 24 too)
    assert layer.stored == 24 + 4  # then 4 decode steps append
    assert layer.peak == 24 + 30


def test_block_size_reads_the_prompt_in_blocks(tiny):
    """`block_size=` is the block `kvtrim.prefill` reads the prompt in by default: what a chunked prefill of the
    plain budget mode keeps, with the peak at `budget + block_size`."""
    model = kvtrim.enable(tiny)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(3))
    blocks = kvtrim.TrimCache(kvtrim.SnapKV(window=4, budget=24, block_size=30), config=model.config)
    chunked = kvtrim.TrimCache(kvtrim.SnapKV(window=4, budget=24), config=model.config)
    one_shot = kvtrim.TrimCache(kvtrim.SnapKV(window=4, budget=24), config=model.config)
    with torch.no_grad():
        kvtrim.prefill(model, ids, blocks)
        kvtrim.prefill(model, ids, chunked, chunk_size=30)
        kvtrim.prefill(model, ids, one_shot)
    for a, b, c in zip(blocks.layers, chunked.layers, one_shot.layers):
        assert a.evictions == 3 and a.peak == 24 + 30 and torch.equal(a.positions, b.positions)
        assert c.evictions == 1 and c.peak == 90
    assert any(not torch.equal(a.positions, c.positions) for a, c in zip(blocks.layers, one_shot.layers))


def test_validation_errors_are_one_line():
    for kwargs, text in [
        ({}, "exactly one of budget"),
        ({"budget": 10, "compression_ratio": 0.5}, "exactly one"),
        ({"budget": 8, "window": 16}, "must be >= window"),
        ({"budget": 64, "kernel": 4}, "odd"),
        ({"budget": 64, "pooling": "mean"}, "pooling"),
        ({"compression_ratio": 1.0}, "compression_ratio"),
        ({"compression_ratio": 0.5, "block_size": 16}, "block_size= needs budget="),
        ({"budget": 64, "block_size": 0}, "block_size must be >= 1"),
    ]:
        with pytest.raises(kvtrim.KvtrimError, match=text) as err:
            kvtrim.SnapKV(**kwargs)
        assert "\n" not in str(err.value)
    assert kvtrim.SnapKV.at_budget(100, 1000, window=16).budget == 100


def test_needs_kvtrim_attention_on_a_stock_model():
    model = tiny_model("llama")  # stock SDPA
    ids = torch.randint(0, 256, (1, 40))
    with pytest.raises(kvtrim.KvtrimError, match="kvtrim.enable"):
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                           cache=kvtrim.TrimCache(kvtrim.SnapKV(budget=36), config=model.config), pad_token_id=0)
