"""TrimCache contracts on tiny random GQA models (float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

import kvtrim
from kvtrim.methods.lagkv import lagkv_stored_length

LAG = kvtrim.LagKV(sink_size=4, lag_size=16, keep_ratio=0.25)


def prompt(n, batch=1, seed=0, vocab=256):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids, cache, new=24, **kw):
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new,
                              pad_token_id=0, **kw)


# ---- exactness with nothing evicted ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 23])
def test_keep_everything_is_bit_identical_to_dynamic_cache(tiny, chunk):
    ids = prompt(90)
    ref = run(tiny, ids, DynamicCache(config=tiny.config), prefill_chunk_size=chunk)
    for method in (kvtrim.FullCache(), kvtrim.LagKV(sink_size=4, lag_size=16, keep_ratio=1.0)):
        got = run(tiny, ids, kvtrim.TrimCache(method, config=tiny.config), prefill_chunk_size=chunk)
        assert torch.equal(ref, got)


def test_sampling_with_keep_everything_matches_dynamic_cache(tiny):
    ids = prompt(60)
    torch.manual_seed(5)
    ref = run(tiny, ids, DynamicCache(config=tiny.config), do_sample=True, temperature=1.0)
    torch.manual_seed(5)
    got = run(tiny, ids, kvtrim.TrimCache(kvtrim.FullCache()), do_sample=True, temperature=1.0)
    assert torch.equal(ref, got)


# ---- lengths, positions, bytes -------------------------------------------------------------------------
def test_stored_length_positions_and_bytes_after_generate(tiny):
    n, new = 150, 40
    cache = kvtrim.TrimCache(LAG, config=tiny.config)
    out = run(tiny, prompt(n), cache, new=new)
    seen = out.shape[-1] - 1  # the last sampled token is never fed back
    assert cache.get_seq_length() == seen
    expected = lagkv_stored_length(seen, 4, 16, 0.25)
    stats = cache.stats()
    assert stats.tokens_seen == seen
    assert stats.stored_per_layer == [expected] * tiny.config.num_hidden_layers
    for layer in cache.layers:
        pos = layer.positions
        assert pos.shape == layer.keys.shape[:3] and pos.dtype == torch.long
        assert (pos.diff(dim=-1) > 0).all() and pos.min() >= 0 and pos.max() == seen - 1
        assert layer.keys.shape[-2] == layer.values.shape[-2] == expected  # physically smaller
    per_entry = 2 * tiny.config.num_key_value_heads * (tiny.config.hidden_size // tiny.config.num_attention_heads) * 4
    layers = tiny.config.num_hidden_layers
    assert stats.bytes_stored == layers * expected * per_entry
    assert stats.bytes_full == layers * seen * per_entry
    assert stats.compression_ratio == pytest.approx(1 - expected / seen)


def test_peak_shows_attend_then_evict_transient(tiny):
    cache = kvtrim.TrimCache(LAG, config=tiny.config)
    run(tiny, prompt(150), cache, new=1)
    # the one-shot prefill held all 150 entries for its own attention, then stored the kept subset
    assert all(layer.peak == 150 for layer in cache.layers)
    assert all(layer.stored == lagkv_stored_length(150, 4, 16, 0.25) for layer in cache.layers)


# ---- attend, then evict ----------------------------------------------------------------------------------
def test_step_that_triggers_eviction_attends_to_everything(tiny):
    sink, lag = 4, 16
    n0 = sink + 2 * lag - 1  # one token short of the first compression
    ids = prompt(n0 + 2)
    with torch.no_grad():
        ref_cache = DynamicCache(config=tiny.config)
        ref_pre = tiny(ids[:, :n0], cache=ref_cache).logits
        ref_step = tiny(ids[:, n0 : n0 + 1], cache=ref_cache).logits
        cache = kvtrim.TrimCache(LAG, config=tiny.config)
        pre = tiny(ids[:, :n0], cache=cache).logits
        assert cache.layers[0].stored == n0  # nothing evicted yet
        step = tiny(ids[:, n0 : n0 + 1], cache=cache).logits  # this step triggers the compression
        assert cache.layers[0].stored < n0 + 1
        nxt = tiny(ids[:, n0 + 1 : n0 + 2], cache=cache).logits
        ref_nxt = tiny(ids[:, n0 + 1 : n0 + 2], cache=ref_cache).logits
    assert torch.equal(pre, ref_pre)
    assert torch.equal(step, ref_step)  # attended to the full cache
    assert not torch.allclose(nxt, ref_nxt)  # the next step sees the compressed cache


def test_one_shot_prefill_with_eviction_is_exact(tiny):
    ids = prompt(150)
    with torch.no_grad():
        ref = tiny(ids, cache=DynamicCache(config=tiny.config)).logits
        got = tiny(ids, cache=kvtrim.TrimCache(LAG, config=tiny.config)).logits
    assert torch.equal(ref, got)


# ---- an independent reference: full cache + a mask hiding what was evicted -----------------------------
def masked_reference_logits(model, ids, n0, kept_before_step):
    """Eager attention over a full DynamicCache, hiding, at each decode step, the entries TrimCache had
    evicted before that step (per layer and KV head, expanded to the query heads of each group)."""
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    cache = DynamicCache(config=cfg)
    logits = []
    with torch.no_grad():
        model(ids[:, :n0], cache=cache)
        for t, kept in enumerate(kept_before_step):
            total = n0 + t + 1
            masks = []
            for layer_kept in kept:  # (batch, kv_heads, n_stored) per layer
                visible = torch.zeros(*layer_kept.shape[:2], total, dtype=torch.bool)
                visible.scatter_(2, layer_kept, True)
                visible[..., -1] = True  # the new token itself
                visible = visible.repeat_interleave(group, dim=1)[:, :, None, :]
                masks.append(torch.where(visible, 0.0, torch.finfo(torch.float32).min))
            # one mask per layer: run layer by layer through a forward hook on each attention module
            handles = []
            for layer_idx, attn in enumerate(model.model.layers):
                def pre(module, args, kwargs, m=masks[layer_idx]):
                    kwargs["attention_mask"] = m
                    return args, kwargs
                handles.append(attn.self_attn.register_forward_pre_hook(pre, with_kwargs=True))
            try:
                out = model(ids[:, total - 1 : total], cache=cache, position_ids=torch.tensor([[total - 1]]))
            finally:
                for h in handles:
                    h.remove()
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


@pytest.mark.parametrize("method", [LAG, kvtrim.StreamingLLM(sink_size=4, budget=40)])
def test_decoding_with_eviction_matches_masked_full_cache_reference(method):
    model = tiny_model("llama", attn_implementation="eager", layers=2)
    n0, steps = 70, 40
    ids = prompt(n0 + steps)
    cache = kvtrim.TrimCache(method, config=model.config)
    kept_before_step = []
    got = []
    with torch.no_grad():
        model(ids[:, :n0], cache=cache)
        kept_before_step.append([layer.kept_positions() for layer in cache.layers])
        for t in range(steps - 1):
            # positions come from the cache's seen count: no position_ids passed here
            got.append(model(ids[:, n0 + t : n0 + t + 1], cache=cache).logits[:, -1])
            kept_before_step.append([layer.kept_positions() for layer in cache.layers])
    ref = masked_reference_logits(model, ids, n0, kept_before_step[:-1])
    assert any(layer.evictions > 1 for layer in cache.layers)
    torch.testing.assert_close(torch.stack(got, 1), ref, rtol=1e-4, atol=1e-4)


# ---- batches -------------------------------------------------------------------------------------------
def test_unpadded_batch_matches_rows_run_alone(tiny):
    ids = prompt(120, batch=2, seed=4)
    cache = kvtrim.TrimCache(LAG, config=tiny.config)
    both = run(tiny, ids, cache, new=20)
    for row in range(2):
        alone_cache = kvtrim.TrimCache(LAG, config=tiny.config)
        alone = run(tiny, ids[row : row + 1], alone_cache, new=20)
        assert torch.equal(both[row], alone[0])
        for layer, alone_layer in zip(cache.layers, alone_cache.layers):
            assert torch.equal(layer.positions[row], alone_layer.positions[0])


def test_padded_batch_under_stock_attention_is_refused_with_a_clear_error(tiny):
    """Stock attention records no padding mask: the cache cannot tell pads from tokens (kvtrim's attention
    can: tests/test_padded.py)."""
    ids = prompt(40, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding on the second row
    with pytest.raises(kvtrim.KvtrimError, match="padded batch .* needs kvtrim's attention"):
        with torch.no_grad():
            tiny.generate(ids, attention_mask=mask, cache=kvtrim.TrimCache(LAG), max_new_tokens=3, pad_token_id=0)


# ---- sliding-window models -------------------------------------------------------------------------------
def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=256, sliding_window=16, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    return Gemma3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def test_sliding_window_layers_are_left_alone():
    model = tiny_gemma3()
    ids = prompt(100)
    ref = run(model, ids, DynamicCache(config=model.config))
    cache = kvtrim.TrimCache(kvtrim.FullCache(), config=model.config)
    assert torch.equal(run(model, ids, cache), ref)
    cache = kvtrim.TrimCache(LAG, config=model.config)
    run(model, ids, cache)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "TrimLayer"] * 2
    stats = cache.stats()
    assert stats.evicting_layers == [1, 3]
    seen = stats.tokens_seen
    assert stats.stored_per_layer[1] == lagkv_stored_length(seen, 4, 16, 0.25)
    assert stats.stored_per_layer[0] == 15  # the sliding layer keeps its own window - 1


def test_unsupported_layer_types_are_refused():
    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(kvtrim.KvtrimError, match="not supported"):
        kvtrim.TrimCache(LAG, config=model.config)


def test_crop_is_refused():
    cache = kvtrim.TrimCache(LAG)
    keys = torch.randn(1, 2, 10, 4)
    cache.update(keys, keys, 0)
    with pytest.raises(kvtrim.KvtrimError, match="cannot be cropped"):
        cache.crop(-2)


# ---- layers of different lengths, missing attention hand-off --------------------------------------------
def test_fit_mask_keeps_stored_visible_and_the_causal_block():
    from kvtrim.attention import fit_mask

    q = 3
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    mask = torch.cat([torch.ones(q, 5, dtype=torch.bool), causal], dim=-1)[None, None]
    fitted = fit_mask(mask, 9 + q)
    assert fitted.shape == (1, 1, q, 12)
    assert fitted[..., :9].all() and torch.equal(fitted[0, 0, :, 9:], causal)
    assert fit_mask(mask, 8) is mask


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_skip_layers_with_chunked_prefill_and_decoding(impl):
    model = kvtrim.enable(tiny_model("llama", attn_implementation=impl))
    ids = prompt(120)
    method = kvtrim.LagKV(sink_size=4, lag_size=16, keep_ratio=0.25, skip_layers=(1,))
    cache = kvtrim.TrimCache(method, config=model.config)
    run(model, ids, cache, new=30, prefill_chunk_size=50)
    seen = cache.get_seq_length()
    assert cache.stats().stored_per_layer == [lagkv_stored_length(seen, 4, 16, 0.25), seen]


def test_sliding_model_without_config_is_refused_by_kvtrim_attention():
    model = kvtrim.enable(tiny_gemma3())
    with pytest.raises(kvtrim.KvtrimError, match="sliding-window layers"):
        run(model, prompt(40), kvtrim.TrimCache(LAG), new=2)


def test_attention_method_on_a_stock_model_fails_within_the_first_forward():
    model = tiny_model("llama")  # stock SDPA, kvtrim attention not enabled
    with pytest.raises(kvtrim.KvtrimError, match="kvtrim.enable"):
        with torch.no_grad():
            model(prompt(40), cache=kvtrim.TrimCache(kvtrim.METHODS["snapkv"](budget=16, window=4)))
