"""AdaKV (head-wise budgets): the allocation rule against a slow reference written from the paper's
definition, the wrapper's refusals and spec syntax, and the cache it produces (ragged, exact against a
per-head masked full cache, allocated bytes within 2 % of ideal)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_ragged_cache import masked_reference_attention
from transformers import AttentionInterface, DynamicCache

from kvtrim import AdaKV, KeyDiff, KNorm, KvtrimError, LagKV, SnapKV, TrimCache, enable
from kvtrim.methods import H2O, TOVA, KVzip, StreamingLLM, adakv_keep
from kvtrim.specs import parse_method_spec


def reference_allocation(scores, n_keep, alpha, first=0, last=0):
    """The rule in words, one sequence at a time: each head keeps its protected entries (earliest first,
    at most n_keep), then tops up to int(n_keep * alpha) with its best others; the layer's remaining
    slots (kv_heads * n_keep in all) go to the best remaining entries of any head. Ties: the earlier
    (head, entry)."""
    b, h, n = scores.shape
    out = torch.zeros(b, h, n, dtype=torch.bool)
    for bi in range(b):
        if n_keep >= n:
            out[bi] = True
            continue
        chosen = set()
        for hi in range(h):
            prot = [j for j in range(n) if j < first or j >= n - last][:n_keep]
            mine = list(prot)
            rest = sorted((j for j in range(n) if j not in prot), key=lambda j: (-float(scores[bi, hi, j]), j))
            mine += rest[: max(0, int(n_keep * alpha) - len(mine))]
            chosen |= {(hi, j) for j in mine}
        others = sorted(((hi, j) for hi in range(h) for j in range(n) if (hi, j) not in chosen),
                        key=lambda e: (-float(scores[bi, e[0], e[1]]), e[0], e[1]))
        chosen |= set(others[: h * n_keep - len(chosen)])
        for hi, j in chosen:
            out[bi, hi, j] = True
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("n_keep,first,last", [(5, 0, 0), (9, 1, 2), (3, 2, 4), (30, 0, 0)])
def test_allocation_matches_the_slow_reference(alpha, n_keep, first, last):
    g = torch.Generator().manual_seed(n_keep + first)
    for scores in (torch.randn(2, 3, 20, generator=g),
                   torch.randint(0, 4, (2, 3, 20), generator=g).float()):  # many ties
        got = adakv_keep(scores, n_keep, alpha, first, last)
        want = reference_allocation(scores, n_keep, alpha, first, last)
        assert torch.equal(got, want)
        assert got.sum((1, 2)).tolist() == [3 * min(n_keep, 20)] * 2


def test_alpha_one_is_the_uniform_method_and_lengths_differ_otherwise():
    scores = torch.randn(1, 4, 50, generator=torch.Generator().manual_seed(0))
    scores[:, 0] *= 10  # a peaky head next to flat ones
    uniform = adakv_keep(scores, 10, 1.0)
    assert uniform.sum(-1).tolist() == [[10] * 4]
    assert torch.equal(uniform, adakv_keep(scores.clone(), 10, 1.0))
    ada = adakv_keep(scores, 10, 0.2)
    counts = ada.sum(-1)[0]
    assert int(counts.sum()) == 40 and len(set(counts.tolist())) > 1 and int(counts.min()) >= 2


@pytest.mark.parametrize("method,message", [
    (TOVA(budget=8), "shared by all heads"),
    (StreamingLLM(budget=8), "own rule"),
    (H2O(budget=8), "own rule"),
    (LagKV(compression_ratio=0.5), "per-partition ranks"),
    (KVzip(compression_ratio=0.5), "not one"),
])
def test_refuses_methods_where_head_budgets_make_no_sense(method, message):
    with pytest.raises(KvtrimError, match=message):
        AdaKV(method)
    with pytest.raises(KvtrimError, match="alpha_safeguard"):
        AdaKV(KNorm(budget=4), alpha_safeguard=1.5)


def test_spec_syntax():
    spec = parse_method_spec("adakv:method=snapkv:window=16:alpha_safeguard=0.3:compression_ratio=0.5")
    method = spec.build()
    assert isinstance(method, AdaKV) and method.alpha_safeguard == 0.3
    assert method.method == SnapKV(window=16, compression_ratio=0.5)
    assert spec.label == "adakv:method=snapkv:window=16:alpha_safeguard=0.3:compression_ratio=0.5"
    # sweeps: budget=, or compression_ratio= under ratio sizing
    assert parse_method_spec("adakv:method=snapkv").build(1000, 0.75).method == SnapKV(budget=250)
    assert parse_method_spec("adakv:method=keydiff").build(1000, 0.5, "ratio").method == KeyDiff(compression_ratio=0.5)
    for text, message in [("adakv", "give method=NAME"), ("adakv:method=nope", "unknown method 'nope'"),
                          ("adakv:method=adakv", "cannot wrap another wrapper"),
                          ("adakv:method=tova", "shared by all heads"), ("adakv:method=knorm:window=3", "no parameter")]:
        with pytest.raises(KvtrimError, match=message):
            parse_method_spec(text)


@pytest.mark.parametrize("inner", [KNorm(compression_ratio=0.5), SnapKV(window=4, kernel=3, compression_ratio=0.6),
                                   KeyDiff(compression_ratio=0.5, sink_size=2)])
def test_generate_with_adakv_is_exact_against_a_masked_full_cache(inner):
    model = enable(tiny_model("llama"))
    prompt = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    method = AdaKV(inner)
    cache = TrimCache(method, config=model.config)
    steps = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(4))
    got = []
    with torch.no_grad():
        got.append(model(prompt, cache=cache).logits)
        for t in steps:
            got.append(model(t.view(1, 1).expand(2, 1), cache=cache).logits)
    n_total = 40 + len(steps)
    hidden = {}
    for layer in cache.trim_layers():
        lengths = layer.lengths
        assert layer.is_ragged and len(set(lengths.flatten().tolist())) > 1
        budget = int(40 * (1 - inner.compression_ratio))
        assert lengths.sum(-1).tolist() == [2 * (budget + len(steps))] * 2  # kv_heads x budget, then decoding
        h = torch.full((2, 2, n_total), 1 << 30)
        for bi in range(2):
            for hi in range(2):
                kept = set(layer.storage.positions[bi, hi, : lengths[bi, hi]].tolist())
                for p in range(40):
                    if p not in kept:
                        h[bi, hi, p] = 40  # evicted when the prompt ended (at the first decode step)
        hidden[layer.layer_idx] = h
    stats = cache.stats()
    assert stats.bytes_allocated <= 1.02 * stats.bytes_ideal
    AttentionInterface.register("kvtrim_test_adakv_ref", masked_reference_attention(hidden))
    ref = tiny_model("llama")
    ref.set_attn_implementation("kvtrim_test_adakv_ref")
    ref_cache = DynamicCache()
    with torch.no_grad():
        want = [ref(prompt, cache=ref_cache).logits] + [ref(t.view(1, 1).expand(2, 1), cache=ref_cache).logits
                                                        for t in steps]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.integration
def test_adakv_on_smollm2_gives_heads_different_lengths(smollm):
    import kvtrim

    model, tokenizer = smollm
    text = ("The quick brown fox jumps over the lazy dog. " * 40) + "What does the fox jump over?"
    ids = tokenizer(text, return_tensors="pt").input_ids
    for spec in ("adakv:method=snapkv:compression_ratio=0.5", "adakv:method=keydiff:compression_ratio=0.5",
                 "adakv:method=knorm:compression_ratio=0.5"):
        cache = TrimCache(parse_method_spec(spec).build(), config=model.config)
        with torch.no_grad():
            kvtrim.generate(model, ids, cache=cache, max_new_tokens=4, min_new_tokens=4)
        stats = cache.stats()
        assert stats.ragged_layers, spec
        per_head = [lengths[0] for lengths in stats.lengths_per_layer]
        assert any(len(set(heads)) > 1 for heads in per_head), spec
        assert stats.bytes_allocated <= 1.02 * stats.bytes_ideal, spec
