"""kvtrim's attention function: exactness with nothing evicted, the probabilities it hands over, switching."""

from __future__ import annotations

import types

import pytest
import torch
from attention_reference import attention_row, rand_qkv
from conftest import tiny_model
from transformers import DynamicCache

import kvtrim
from kvtrim.attention import EAGER, SDPA, attend_with_probabilities
from kvtrim.cli import build_parser, method_from_args


def prompt(n, seed=0):
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids, cache, new=12, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True, **kw)


def same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


# ---- the probability path ------------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_attend_with_probabilities_matches_loop_reference(hq, hkv, mask_kind):
    q, k, v = rand_qkv(2, hq, hkv, 9, d=8, seed=hq)
    q = q[:, :, -3:]  # 3 queries at positions 6, 7, 8
    causal = torch.arange(9)[None, :] <= torch.arange(6, 9)[:, None]
    mask = None
    if mask_kind == "bool":
        mask = causal[None, None]
    elif mask_kind == "float":
        mask = torch.zeros(1, 1, 3, 9).masked_fill(~causal, torch.finfo(torch.float32).min)
    out, probs = attend_with_probabilities(q, k, v, mask, 0.35)
    assert out.shape == (2, 3, hq, 8) and probs.shape == (2, hq, 3, 9)
    g = hq // hkv
    for b in range(2):
        for h in range(hq):
            for i in range(3):
                visible = 9 if mask is None else 7 + i
                row = attention_row(q[b, h, i], [k[b, h // g, j] for j in range(visible)], 0.35)
                want = torch.tensor(row + [0.0] * (9 - visible), dtype=torch.float32)
                assert torch.allclose(probs[b, h, i], want, atol=1e-6)
                assert torch.allclose(out[b, i, h], want @ v[b, h // g], atol=1e-5)


def _matmul_4d(query, key, value, mask, scaling, softcap=None):
    """The probability path as first written (`matmul` on 4-D tensors, then the scale): the bits that
    `attend_with_probabilities` must keep (its `bmm` form only dispatches less)."""
    b, h, q, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    logits = (torch.matmul(query.reshape(b, hkv, h // hkv * q, d), key.transpose(-1, -2)) * scaling).view(b, h, q, n)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is not None:
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min) if mask.dtype == torch.bool else logits + mask
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.view(b, hkv, h // hkv * q, n), value).view(b, h, q, value.shape[-1])
    return out.transpose(1, 2).contiguous(), probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,q,n", [(9, 3, 1, 509), (2, 2, 1, 7), (4, 1, 5, 130), (14, 2, 1, 1100)])
@pytest.mark.parametrize("mask_kind,softcap,scaling", [(None, None, 0.125), ("bool", None, 0.11),
                                                       ("float", 30.0, 0.0883883)])
def test_attend_with_probabilities_keeps_the_bits_of_the_4d_matmul_form(dtype, hq, hkv, q, n, mask_kind, softcap,
                                                                       scaling):
    gen = torch.Generator().manual_seed(n + q)
    query = torch.randn(2, hq, q, 64, generator=gen).to(dtype)
    buf = torch.randn(2, hkv, n + 40, 64, generator=gen).to(dtype)
    key, value = buf[:, :, :n], buf[:, :, 40:]  # slices of a longer buffer, as a cache layer may hand over
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, q, n, generator=gen) > 0.2
    elif mask_kind == "float":
        mask = torch.randn(2, 1, q, n, generator=gen).to(dtype)
    out, probs = attend_with_probabilities(query, key, value, mask, scaling, softcap)
    want_out, want_probs = _matmul_4d(query, key, value, mask, scaling, softcap)
    assert torch.equal(probs, want_probs) and torch.equal(out, want_out)


def test_softcap_is_applied_before_the_softmax():
    q, k, v = rand_qkv(1, 2, 1, 5, seed=1)
    q = q[:, :, -1:] * 10
    _, probs = attend_with_probabilities(q, k, v, None, 1.0, softcap=2.0)
    logits = torch.tanh((q[0, :, 0] @ k[0, 0].T) / 2.0) * 2.0
    assert torch.allclose(probs[0, :, 0], logits.softmax(-1), atol=1e-6)


# ---- switching a model ------------------------------------------------------------------------------
def test_enable_disable_roundtrip_and_errors():
    model = tiny_model("llama")
    assert not kvtrim.is_enabled(model)
    assert kvtrim.enable(model) is model and model.config._attn_implementation == SDPA
    kvtrim.enable(model)  # idempotent
    assert kvtrim.is_enabled(model)
    kvtrim.disable(model)
    assert model.config._attn_implementation == "sdpa"
    eager = kvtrim.enable(tiny_model("llama", attn_implementation="eager"))
    assert eager.config._attn_implementation == EAGER
    fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(kvtrim.KvtrimError, match="wraps 'sdpa' or 'eager'"):
        kvtrim.enable(fake)


# ---- exactness when nothing is evicted ---------------------------------------------------------------
@pytest.mark.parametrize("chunk", [None, 17])
def test_kvtrim_sdpa_is_bit_identical_to_stock_sdpa(tiny, chunk):
    ids = prompt(60)
    stock = run(tiny, ids, DynamicCache(config=tiny.config), prefill_chunk_size=chunk)
    evicting = run(tiny, ids, kvtrim.TrimCache(kvtrim.StreamingLLM(budget=30), config=tiny.config),
                   prefill_chunk_size=chunk)
    model = kvtrim.enable(tiny)
    for method in (kvtrim.FullCache(), kvtrim.SnapKV(budget=1000)):  # SnapKV: queries handed, SDPA path
        assert same(run(model, ids, kvtrim.TrimCache(method, config=model.config), prefill_chunk_size=chunk), stock)
    # an attention-free method evicting: the same with stock and kvtrim attention
    assert same(run(model, ids, kvtrim.TrimCache(kvtrim.StreamingLLM(budget=30), config=model.config),
                    prefill_chunk_size=chunk), evicting)


def test_kvtrim_eager_is_bit_identical_to_stock_eager_even_for_attention_methods():
    eager = tiny_model("llama", attn_implementation="eager")
    ids = prompt(50, seed=1)
    stock = run(eager, ids, DynamicCache(config=eager.config))
    kvtrim.enable(eager)
    for method in (kvtrim.FullCache(), kvtrim.H2O(budget=1000), kvtrim.LazyEviction(budget=1000, window=4)):
        assert same(run(eager, ids, kvtrim.TrimCache(method, config=eager.config)), stock)


@pytest.mark.parametrize(
    "method", [kvtrim.H2O(budget=1000), kvtrim.TOVA(budget=1000), kvtrim.LazyEviction(budget=1000, window=4)]
)
def test_probability_path_matches_stock_sdpa_when_nothing_is_evicted(tiny, method):
    ids = prompt(50, seed=2)
    stock = run(tiny, ids, DynamicCache(config=tiny.config))
    got = run(kvtrim.enable(tiny), ids, kvtrim.TrimCache(method, config=tiny.config))
    assert torch.equal(got.sequences, stock.sequences)
    assert torch.equal(got.scores[0], stock.scores[0])  # the prefill runs stock SDPA
    for a, b in zip(got.scores[1:], stock.scores[1:]):  # decode steps: explicit softmax, same math
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


# ---- the probabilities handed over produced the output ---------------------------------------------
class Spy(kvtrim.FullCache):
    """Records what kvtrim's attention hands over, and the values the step attended to."""

    needs_attention = True

    def __init__(self):
        self.calls = []

    def on_attention(self, view):
        self.calls.append((view.layer_idx, view.queries.clone(),
                           None if view.attention is None else view.attention.clone(),
                           view.keys.clone(), view.values.clone(), view.scaling))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_handed_probabilities_are_those_that_produced_the_output(kind):
    model = kvtrim.enable(tiny_model(kind, q_heads=6, kv_heads=2))
    outputs = []
    hooks = [layer.self_attn.o_proj.register_forward_hook(lambda m, args, out: outputs.append(args[0].clone()))
             for layer in model.model.layers]
    spy = Spy()
    try:
        run(model, prompt(30, seed=3), kvtrim.TrimCache(spy, config=model.config), new=4)
    finally:
        for h in hooks:
            h.remove()
    assert len(spy.calls) == len(outputs) == 2 * 4  # 2 layers x (prefill + 3 decode steps)
    decode = [(c, o) for c, o in zip(spy.calls, outputs) if c[2] is not None]
    assert len(decode) == 2 * 3
    for (idx, q, probs, keys, values, scale), out in decode:
        b, hq, _, n = probs.shape
        hkv = values.shape[1]
        assert q.shape == (1, 6, 1, 16) and probs.shape == (1, 6, 1, keys.shape[2])
        # the layer's output is exactly these probabilities times the values
        mixed = (probs.view(b, hkv, hq // hkv, n) @ values).view(b, hq, 1, -1).transpose(1, 2).reshape(b, 1, -1)
        assert torch.equal(out, mixed)
        # and they are the softmax of the handed-over (post-RoPE) queries against the keys
        for h in range(hq):
            want = torch.tensor(attention_row(q[0, h, 0], list(keys[0, h // (hq // hkv)]), scale))
            assert torch.allclose(probs[0, h, 0], want.float(), atol=1e-6)
    assert all(c[2] is None and c[1].shape[2] == 30 for c in spy.calls[:2])  # the prefill: queries only


# ---- the error path on a stock model -------------------------------------------------------------------
@pytest.mark.parametrize(
    "method", [kvtrim.H2O(budget=20), kvtrim.TOVA(budget=20), kvtrim.LazyEviction(budget=20, window=4)]
)
def test_attention_methods_on_a_stock_model_fail_with_a_clear_error(method):
    model = tiny_model("llama")
    with pytest.raises(kvtrim.KvtrimError, match=r"needs kvtrim's attention function: call kvtrim.enable\(model\)"):
        run(model, prompt(30), kvtrim.TrimCache(method, config=model.config), new=3)


def test_attention_free_methods_work_on_a_stock_model():
    model = tiny_model("qwen2", q_heads=6, kv_heads=2)
    out = run(model, prompt(80), kvtrim.TrimCache(kvtrim.LagKV(sink_size=4, lag_size=16, keep_ratio=0.5)), new=8)
    assert out.sequences.shape[-1] == 88


# ---- the command line picks the methods up ----------------------------------------------------------
def test_cli_builds_the_attention_methods():
    parser = build_parser()
    make = lambda *argv: method_from_args(parser.parse_args(["generate", *argv]))  # noqa: E731
    assert make("--method", "snapkv", "--budget", "64", "--pooling", "avg", "--kernel", "5") == kvtrim.SnapKV(
        budget=64, pooling="avg", kernel=5)
    assert make("--method", "h2o", "--heavy-budget", "8", "--recent-budget", "8").budgets() == (8, 8)
    assert make("--method", "tova", "--budget", "32") == kvtrim.TOVA(budget=32)
    assert make("--method", "lazyeviction", "--budget", "64", "--window", "16", "--alpha", "5e-4",
                "--gqa", "per_query_head") == kvtrim.LazyEviction(budget=64, window=16, alpha=5e-4,
                                                                  gqa="per_query_head")
    with pytest.raises(kvtrim.KvtrimError, match="pooling"):
        make("--method", "snapkv", "--budget", "64", "--pooling", "mean")


@pytest.mark.integration
def test_real_model_loads_with_kvtrim_attention_and_matches_stock(smollm):
    model, tok = smollm
    assert kvtrim.is_enabled(model)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    got = run(model, ids, kvtrim.TrimCache(kvtrim.FullCache(), config=model.config), new=6)
    kvtrim.disable(model)
    try:
        stock = run(model, ids, DynamicCache(config=model.config), new=6)
    finally:
        kvtrim.enable(model)
    assert same(got, stock)
