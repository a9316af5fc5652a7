"""H2O and TOVA: kept positions at every step vs loop references, timing rules, budgets."""

from __future__ import annotations

import pytest
import torch
from attention_reference import drive, h2o_reference, rand_qkv, tova_reference

import kvtrim
from kvtrim.methods.attention_scores import causal_attention
from kvtrim.methods.h2o import prompt_attention_sums

SHAPES = [(1, 1), (4, 2), (6, 2), (8, 1)]


# ---- H2O --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", SHAPES)
@pytest.mark.parametrize("prompt", [6, 20])
def test_h2o_kept_positions_match_loop_reference_at_every_step(hq, hkv, prompt):
    heavy, recent, scale = 5, 4, 0.5
    q, k, v = rand_qkv(2, hq, hkv, 40, seed=hq + prompt)
    expected = h2o_reference(q, k, prompt, heavy, recent, scale)
    layer, history = drive(kvtrim.H2O(heavy_budget=heavy, recent_budget=recent, prefill_block=7), q, k, v, prompt,
                           scale)
    assert [h.tolist() for h in history] == expected


def test_h2o_cache_size_rule():
    q, k, v = rand_qkv(1, 4, 2, 60, seed=1)
    layer, history = drive(kvtrim.H2O(budget=10), q, k, v, 4, 0.5)
    sizes = [h.shape[-1] for h in history]
    assert sizes == list(range(4, 11)) + [10] * (len(sizes) - 7)  # grows to the budget, then one in, one out
    assert layer.peak == 11 and layer.evictions == len(sizes) - 7
    assert (history[-1][..., -5:] == torch.arange(55, 60)).all()  # the recent half is always the newest
    layer, history = drive(kvtrim.H2O(budget=10), q, k, v, 30, 0.5)
    assert history[0].shape[-1] == 10  # a long prompt is cut in one go
    assert layer.peak == 30


def test_h2o_prompt_sums_are_exact_for_any_block():
    q, k, _ = rand_qkv(2, 6, 2, 33, seed=2)
    full = causal_attention(q, k, 0.3).sum(dim=(2, 3))
    for block in (1, 5, 33, 100):
        assert torch.allclose(prompt_attention_sums(q, k, 0.3, block), full, atol=1e-6)
    # the last 10 positions only (a later chunk): rows sit at positions 23..32
    part = causal_attention(q[:, :, -10:], k, 0.3).sum(dim=(2, 3))
    assert torch.allclose(prompt_attention_sums(q[:, :, -10:], k, 0.3, 4), part, atol=1e-6)
    # each query row sums to one: total mass = group * queries
    assert torch.allclose(full.sum(-1), torch.full((2, 2), 3.0 * 33))


def test_h2o_takes_its_prompts_sums_reduced_chunk_by_chunk():
    """`attention_sums` instead of the prompt's queries (what the vLLM engine hands over, added up per prefill
    chunk): the same kept positions as the queries give; a padded batch refuses them in one line."""
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 6, 50, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    sums = torch.zeros(1, 2, 50)
    for c in (0, 13, 32):  # chunks of 13, 19 and 18 rows
        stop = {0: 13, 13: 32, 32: 50}[c]
        sums[..., :stop] += prompt_attention_sums(q[:, :, c:stop], k[:, :, :stop], 0.25, 8)
    kept = []
    for how in ("queries", "sums"):
        cache = kvtrim.TrimCache(kvtrim.H2O(budget=20))
        with cache.phase(kvtrim.Phase.PREFILL, ends_prompt=True):
            cache.update(k.clone(), v.clone(), 0)
        cache.layers[0].after_attention(q if how == "queries" else None, None, 0.25,
                                        sums if how == "sums" else None)
        kept.append(cache.layers[0].kept_positions())
    assert kept[0].shape[-1] == 20 and torch.equal(kept[0], kept[1])


def test_h2o_prompt_sums_match_the_dense_reference_for_any_layout():
    """The blocked, in-place computation against the dense softmax of the whole prompt: GQA groups of 7
    (Qwen2.5's 14 / 2), a batch, queries that are a transposed view (as attention hands them over), bf16
    inputs (scored in float32), a later chunk (q_len < n) with a block that does not divide it."""
    torch.manual_seed(4)
    q = torch.randn(2, 37, 14, 16).transpose(1, 2)  # (b, q_heads, n, d), not contiguous
    k = torch.randn(2, 2, 37, 16)
    full = causal_attention(q, k, 0.25).sum(dim=(2, 3))
    for block in (1, 3, 16, 37, 64):
        assert torch.allclose(prompt_attention_sums(q, k, 0.25, block), full, atol=1e-5)
    part = causal_attention(q[:, :, -11:], k, 0.25).sum(dim=(2, 3))
    assert torch.allclose(prompt_attention_sums(q[:, :, -11:], k, 0.25, 4), part, atol=1e-5)
    half = causal_attention(q.bfloat16(), k.bfloat16(), 0.25).sum(dim=(2, 3))
    got = prompt_attention_sums(q.bfloat16(), k.bfloat16(), 0.25, 8)
    assert got.dtype == torch.float32 and torch.allclose(got, half, atol=1e-4)


def test_h2o_budget_forms():
    assert kvtrim.H2O(budget=11).budgets() == (5, 6)
    assert kvtrim.H2O(heavy_budget=3, recent_budget=9).budgets() == (3, 9)
    assert kvtrim.H2O(compression_ratio=0.5).budgets(100) == (25, 25)
    q, k, v = rand_qkv(1, 4, 2, 50, seed=3)
    layer, history = drive(kvtrim.H2O(compression_ratio=0.75), q, k, v, 40, 0.5)
    assert [h.shape[-1] for h in history] == [10] * 11  # fixed at the prompt's budget while decoding
    assert kvtrim.H2O.at_budget(64, 1000).budgets() == (32, 32)
    for kwargs, text in [
        ({}, "exactly one"),
        ({"heavy_budget": 4}, "both"),
        ({"budget": 8, "compression_ratio": 0.5}, "exactly one"),
        ({"heavy_budget": 4, "recent_budget": 0}, "recent_budget"),
        ({"budget": 1}, "budget"),
        ({"budget": 8, "prefill_block": 0}, "prefill_block"),
    ]:
        with pytest.raises(kvtrim.KvtrimError, match=text):
            kvtrim.H2O(**kwargs)


def test_h2o_without_probabilities_refuses_nothing_but_uses_queries():
    """Decode steps without handed probabilities (e.g. a custom caller) fall back to recomputing from queries."""
    q, k, v = rand_qkv(1, 4, 2, 30, seed=5)
    _, with_probs = drive(kvtrim.H2O(budget=8), q, k, v, 10, 0.5, probs=True)
    _, from_queries = drive(kvtrim.H2O(budget=8), q, k, v, 10, 0.5, probs=False)
    assert [h.tolist() for h in with_probs] == [h.tolist() for h in from_queries]


# ---- TOVA -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", SHAPES)
@pytest.mark.parametrize("prompt", [5, 20])
def test_tova_kept_positions_match_loop_reference_at_every_step(hq, hkv, prompt):
    budget, scale = 9, 0.5
    q, k, v = rand_qkv(2, hq, hkv, 40, seed=hq * 3 + prompt)
    expected = tova_reference(q, k, prompt, budget, scale)
    layer, history = drive(kvtrim.TOVA(budget=budget), q, k, v, prompt, scale)
    for got, want in zip(history, expected):
        assert got.tolist() == [[w] * hkv for w in want]  # one set per layer, the same in every KV head


def test_tova_cache_size_rule_and_validation():
    q, k, v = rand_qkv(1, 4, 2, 40, seed=6)
    layer, history = drive(kvtrim.TOVA(budget=12), q, k, v, 5, 0.5)
    sizes = [h.shape[-1] for h in history]
    assert sizes == list(range(5, 13)) + [12] * (len(sizes) - 8)
    assert layer.peak == 13
    with pytest.raises(kvtrim.KvtrimError, match="budget"):
        kvtrim.TOVA()
    with pytest.raises(kvtrim.KvtrimError, match="budget"):
        kvtrim.TOVA(budget=0)
    assert kvtrim.TOVA.at_budget(7, 100).budget == 7


@pytest.mark.parametrize("method", [kvtrim.H2O(budget=24), kvtrim.TOVA(budget=24)])
def test_generate_on_tiny_model_holds_the_budget(tiny, method):
    model = kvtrim.enable(tiny)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(3))
    cache = kvtrim.TrimCache(method, config=model.config)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=20,
                             min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out.shape[-1] == 70
    for layer in cache.layers:
        assert layer.stored == 24 and layer.seen == 69
        kept = layer.kept_positions()  # in-place decoding stores them in slot order
        assert kept[..., -1].eq(68).all() or isinstance(method, kvtrim.TOVA)
        assert (kept.diff(dim=-1) > 0).all()
