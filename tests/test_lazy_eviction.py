"""LazyEviction: state updates on hand-made attention, score ordering, loop reference, timing, real model."""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import drive, lazy_reference, rand_qkv
from conftest import tiny_model

import kvtrim
from kvtrim.attention import attend_with_probabilities
from kvtrim.cache import TrimLayer
from kvtrim.generate import encode_prompt
from kvtrim.calibrate import PRESETS
from kvtrim.methods.lazy_eviction import mri_scores


def feed(layer: TrimLayer, rows: list[list[float]]) -> None:
    """One decode step: append an entry, hand over one query's attention `rows` (one list per query head)."""
    b, h = 1, layer.keys.shape[1]
    layer.update(torch.zeros(b, h, 1, 4), torch.zeros(b, h, 1, 4))
    layer.after_attention(None, torch.tensor(rows)[None, :, None, :], 0.5)


def prompt_layer(method, n=3, kv_heads=1) -> TrimLayer:
    layer = TrimLayer(method, 0)
    layer.update(torch.zeros(1, kv_heads, n, 4), torch.zeros(1, kv_heads, n, 4))
    layer.after_attention(torch.zeros(1, kv_heads, n, 4), None, 0.5)
    return layer


# ---- per-step state on a hand-made attention sequence -----------------------------------------------
def test_ts_and_mri_follow_the_official_update():
    layer = prompt_layer(kvtrim.LazyEviction(budget=100, window=50, alpha=0.1))
    assert layer.state.ts is None  # tracking starts at the first decode step
    steps = [
        ([0.5, 0.05, 0.05, 0.4], [1, 0, 0, 1], [1, 0, 0, 1]),  # first step: everything starts at TS = MRI = 0
        ([0.5, 0.3, 0.0, 0.0, 0.2], [2, 2, 0, 1, 2], [1, 2, 0, 1, 1]),  # new entry starts at TS = t - 1
        ([0.2, 0.0, 0.0, 0.3, 0.0, 0.5], [3, 2, 0, 3, 2, 3], [1, 2, 0, 2, 1, 1]),
        ([0.1, 0.0, 0.5, 0.0, 0.0, 0.0, 0.4], [4, 2, 4, 3, 2, 3, 4], [1, 2, 4, 2, 1, 1, 1]),  # 0.1 >= alpha
    ]
    for t, (row, ts, mri) in enumerate(steps, start=1):
        feed(layer, [row])
        assert layer.state.step == t
        assert layer.state.ts.tolist() == [[ts]] and layer.state.mri.tolist() == [[mri]]
        assert layer.state.ts.dtype == torch.int32


def test_first_eviction_on_hand_made_attention():
    layer = prompt_layer(kvtrim.LazyEviction(budget=4, window=2, alpha=0.1))
    feed(layer, [[0.5, 0.05, 0.05, 0.4]])  # t=1: no eviction (t % W != 0)
    assert layer.stored == 4
    feed(layer, [[0.5, 0.3, 0.0, 0.0, 0.2]])  # t=2, 5 > 4 entries: candidates 0, 1, 2 keep 2 of them
    # scores at t=2: entry 0 (TS 2, MRI 1) 1.54 > entry 1 (TS 2, MRI 2) 1.08 > entry 2 (MRI 0, quiet) 0
    assert layer.positions.tolist() == [[[0, 1, 3, 4]]]
    assert layer.state.ts.tolist() == [[[2, 2, 1, 2]]] and layer.state.mri.tolist() == [[[1, 2, 1, 1]]]


def test_gqa_modes_on_hand_made_attention():
    rows = [[0.3, 0.05, 0.2, 0.45], [0.3, 0.12, 0.05, 0.53]]  # two query heads of one KV head, alpha = 0.1
    for gqa, ts in [("max", [[1, 1, 1, 1]]), ("mean", [[1, 0, 1, 1]]), ("per_query_head", [[1, 0, 1, 1], [1, 1, 0, 1]])]:
        layer = prompt_layer(kvtrim.LazyEviction(budget=10, window=2, alpha=0.1, gqa=gqa))
        feed(layer, rows)
        assert layer.state.ts[0].tolist() == ts, gqa


@pytest.mark.parametrize("gqa", ["max", "mean", "per_query_head"])
def test_activity_in_bfloat16_is_the_float32_rule(gqa):
    """bfloat16 probabilities (the engine's) are active by the float32 rule in every mode: compared with alpha in
    float32 (alpha = 0.0102 rounds down to 0.010193 in bfloat16, which would make that value active) and a group's
    mean taken in float32 (0.010193, 0.010193, 0.010254: 0.0102134 in float32, 0.010193 in bfloat16)."""
    from kvtrim.methods.lazy_eviction import activity

    torch.manual_seed(5)
    near = torch.tensor([0.0101, 0.010193, 0.010254, 0.0103, 0.5, 0.0]).bfloat16()
    probs = near[torch.randint(0, 4, (2, 9, 40))]  # (batch, q_heads, n): 3 KV heads of 3 query heads
    probs[0, :3, 0] = near[torch.tensor([1, 1, 2])]
    a = probs.float()
    g = a.view(2, 3, 3, 40)
    want = {"max": g.amax(dim=2) >= 0.0102, "mean": g.mean(dim=2) >= 0.0102, "per_query_head": a >= 0.0102}[gqa]
    got = activity(probs, 3, 0.0102, gqa)
    assert want.any() and not want.all()
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert torch.equal(activity(probs[:, :, ::2], 3, 0.0102, gqa), want[:, :, ::2])  # a strided view too


def test_counters_stay_exact_past_fp16_range():
    layer = prompt_layer(kvtrim.LazyEviction(budget=6, window=3, alpha=0.01))
    for _ in range(2101):
        n = layer.stored + 1
        feed(layer, [[1.0 / n] * n])  # everything active at every step
    assert layer.state.step == 2101
    assert layer.state.ts.max().item() == 2101  # fp16 would round 2101 to 2100
    assert (layer.state.mri == 1).all() and layer.stored <= 6 + 3


# ---- the score ------------------------------------------------------------------------------------
def score(ts, mri, t):
    return mri_scores(torch.tensor([ts], dtype=torch.int32), torch.tensor([mri], dtype=torch.int32), t).item()


def test_mri_score_matches_the_official_formula_and_its_consequences():
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    for ts, mri, t in [(5, 3, 9), (10, 1, 10), (0, 0, 0), (2, 7, 40)]:
        h1 = 2 * sig(-(1 + (t - ts) / (mri + 1e-5)))
        h2 = 0 if mri == 0 else 2 * sig(1 - mri)
        assert score(ts, mri, t) == pytest.approx(h1 + h2, rel=1e-6)
    t = 1000
    # always-active tokens (MRI 1) score >= 1 forever, even after a long quiet phase
    assert min(score(t - quiet, 1, t) for quiet in range(0, 1000)) >= 1.0
    # MRI 2 peaks at 1.08; MRI >= 3 stays <= 0.78 and decays toward 2 sigmoid(1 - m) as the quiet phase grows
    assert score(t, 2, t) == pytest.approx(1.0757, abs=1e-3)
    for m in (3, 5, 10):
        values = [score(t - quiet, m, t) for quiet in range(0, 200)]
        assert max(values) <= 0.78
        assert all(a >= b for a, b in zip(values, values[1:])) and values[0] > values[m] > values[-1]
        assert values[-1] == pytest.approx(2 * sig(1 - m), abs=0.02)
    # a consistent token beats an intermittent one that is fresh; among intermittent ones the freshest wins
    assert score(t - 300, 1, t) > score(t, 3, t) > score(t - 2, 3, t) > score(t - 2, 6, t)
    # never active since tracking began: only just-born (quiet 0) entries get anything
    assert score(t, 0, t) == pytest.approx(2 * sig(-1), rel=1e-6) and score(t - 1, 0, t) < 1e-6


# ---- against the loop reference ------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2), (6, 2), (8, 1)])
@pytest.mark.parametrize("gqa", ["max", "mean", "per_query_head"])
def test_kept_positions_and_state_match_loop_reference(hq, hkv, gqa):
    prompt, n, budget, window, alpha, scale = 10, 42, 14, 4, 0.06, 0.5
    q, k, v = rand_qkv(1, hq, hkv, n, seed=hq + len(gqa))
    expected = lazy_reference(q, k, prompt, budget, window, alpha, gqa, scale)
    method = kvtrim.LazyEviction(budget=budget, window=window, alpha=alpha, gqa=gqa)
    layer = TrimLayer(method, 0)
    layer.update(k[:, :, :prompt], v[:, :, :prompt])
    layer.after_attention(q[:, :, :prompt], None, scale)
    for step, pos in enumerate(range(prompt, n)):
        full_k, full_v = layer.update(k[:, :, pos : pos + 1], v[:, :, pos : pos + 1])
        _, probs = attend_with_probabilities(q[:, :, pos : pos + 1], full_k, full_v, None, scale)
        layer.after_attention(q[:, :, pos : pos + 1], probs, scale)
        want = expected[step]
        assert layer.positions.tolist() == want["kept"], step
        assert layer.state.ts.tolist() == want["ts"] and layer.state.mri.tolist() == want["mri"], step
    assert layer.evictions >= 5


def test_group_of_one_makes_all_gqa_modes_the_official_method():
    q, k, v = rand_qkv(1, 2, 2, 40, seed=9)
    runs = [drive(kvtrim.LazyEviction(budget=12, window=4, alpha=0.06, gqa=g), q, k, v, 8, 0.5)[1]
            for g in ("max", "mean", "per_query_head")]
    assert [h.tolist() for h in runs[0]] == [h.tolist() for h in runs[1]] == [h.tolist() for h in runs[2]]


# ---- timing ---------------------------------------------------------------------------------------
def test_evicts_every_window_steps_and_oscillates_between_budget_and_budget_plus_window():
    budget, window = 16, 5
    q, k, v = rand_qkv(1, 4, 2, 70, seed=11)
    layer, history = drive(kvtrim.LazyEviction(budget=budget, window=window, alpha=0.05), q, k, v, 10, 0.5)
    sizes = [h.shape[-1] for h in history]  # sizes[t] = stored after decode step t
    assert sizes[:10] == list(range(10, 20)) and sizes[10] == budget  # t=5: 15 <= 16 entries, nothing to do
    for t in range(1, len(sizes)):
        if t % window == 0 and sizes[t - 1] + 1 > budget:
            assert sizes[t] == budget
        else:
            assert sizes[t] == sizes[t - 1] + 1
    assert layer.peak == budget + window and layer.evictions == (len(sizes) - 1) // window - 1
    # the newest `window` entries survive every eviction
    assert (history[10][..., -window:] == torch.arange(15, 20)).all()


def test_prompt_is_not_compressed_at_prefill_and_a_new_prefill_restarts_tracking():
    q, k, v = rand_qkv(1, 4, 2, 40, seed=12)
    layer, history = drive(kvtrim.LazyEviction(budget=8, window=4, alpha=0.05), q, k, v, 30, 0.5)
    assert history[0].shape[-1] == 30 and history[3].shape[-1] == 33 and history[4].shape[-1] == 8
    layer.update(k[:, :, :5], v[:, :, :5])  # a second multi-token forward (e.g. a new turn)
    layer.after_attention(q[:, :, :5], None, 0.5)
    assert layer.state.step == 0 and layer.state.ts is None


def test_validation_presets_and_budget_form():
    for kwargs, text in [
        ({}, "budget="),
        ({"budget": 10, "window": 10}, "exceed window"),
        ({"budget": 10, "window": 0}, "window"),
        ({"budget": 10, "window": 2, "alpha": 0.0}, "alpha"),
        ({"budget": 10, "window": 2, "gqa": "sum"}, "gqa"),
    ]:
        with pytest.raises(kvtrim.KvtrimError, match=text) as err:
            kvtrim.LazyEviction(**kwargs)
        assert "\n" not in str(err.value)
    m = kvtrim.lazy_eviction_preset("DeepSeek-R1-Distill-Qwen-7B", "math500")
    assert (m.budget, m.window, m.alpha) == (1492, 175, 1e-4)
    m = kvtrim.lazy_eviction_preset("deepseek-r1-distill-llama-8b", "gsm8k", budget=500, gqa="per_query_head")
    assert (m.budget, m.window, m.alpha, m.gqa) == (500, 27, 5e-4, "per_query_head")
    assert len(PRESETS) == 6
    with pytest.raises(kvtrim.KvtrimError, match="no LazyEviction preset"):
        kvtrim.lazy_eviction_preset("llama", "gsm8k")
    assert kvtrim.LazyEviction.at_budget(300, 2000, window=64).budget == 300


def test_estimate_window_on_a_tiny_model():
    model = tiny_model("llama")
    with pytest.raises(kvtrim.KvtrimError, match="kvtrim.enable"):
        kvtrim.estimate_window(model, None, ["x"])
    kvtrim.enable(model)

    class Tok:  # a stand-in tokenizer: fixed token ids, no chat template
        def __call__(self, text, return_tensors=None):
            ids = torch.tensor([[(ord(c) * 7) % 256 for c in text]])
            return type("Enc", (), {"input_ids": ids})()

    prompts = ["hello there, a short prompt"]
    w = kvtrim.estimate_window(model, Tok(), prompts, max_new_tokens=16, alpha=0.02, chat=False)
    top = kvtrim.estimate_window(model, Tok(), prompts, max_new_tokens=16, alpha=0.02, chat=False, percentile=100)
    assert 1 <= w <= top <= 15  # an MRI never exceeds the number of decode steps


# ---- real model -----------------------------------------------------------------------------------
@pytest.mark.integration
def test_long_decode_with_model_generate(smollm):
    model, tok = smollm
    assert kvtrim.is_enabled(model)  # load_model switches to kvtrim attention by default
    text = ("The old lighthouse stood on a rock at the edge of the bay. Every night its keeper, Mara, climbed the "
            "ninety steps to light the lamp, wrote the weather in a logbook and watched the ships pass. One "
            "morning after a storm she found a green bottle wedged between the stones, with a folded letter "
            "inside. The letter was written in a language she did not know, except for one word: her own name. "
            "Continue the story in detail, describing what Mara did over the following weeks.")
    ids = encode_prompt(tok, text, chat=True)  # 133 tokens
    budget, window, new = 96, 32, 256
    method = kvtrim.LazyEviction(budget=budget, window=window)
    cache = kvtrim.TrimCache(method, config=model.config)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
        full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=window + 1,
                              min_new_tokens=window + 1, do_sample=False)
    n = ids.shape[-1]
    assert n > budget  # the prompt itself is over budget, and stays until decode step W
    # nothing is evicted before decode step W: the first W + 1 tokens are the full cache's
    assert torch.equal(out[0, n : n + window + 1], full[0, n:])
    steps = new - 1
    for layer in cache.layers:
        assert layer.state.step == steps and layer.state.ts.max().item() == steps
        assert layer.peak == n + window  # the uncompressed prompt plus W tokens, at the first eviction
        assert budget <= layer.stored < budget + window
        assert layer.evictions == steps // window
