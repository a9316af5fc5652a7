"""KVzip pure functions against slow references written here (reconstruction inputs, scoring, selection),
and a tiny random model end to end (reconstruction forwards on a prefilled DynamicCache, cut back)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_model
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from kvtrim.methods.base import KvtrimError
from kvtrim.methods.kvzip import (
    KVzip,
    FIRST_PROMPT,
    LATER_PROMPT,
    ReconstructionPieces,
    chat_context,
    kept_in_pool,
    mask_to_indices,
    reconstruction_chunks,
    reconstruction_pieces,
    reconstruction_scores,
    select_global,
    select_uniform,
)

PIECES = ReconstructionPieces(first_prompt=(1, 2, 3), later_prompt=(4, 5), separator=(6, 7))


# ---- reconstruction inputs -------------------------------------------------------------------------
def slow_chunks(ctx: list[int], pieces: ReconstructionPieces, offset: int, size: int, tail: int):
    """The official `chunk_fn` + `self_task` written as plain list slicing."""
    parts = [ctx[i:i + size] for i in range(0, len(ctx), size)]
    out = []
    for i, part in enumerate(parts):
        prompt = list(pieces.first_prompt) if i == 0 else list(pieces.later_prompt) + (parts[i - 1][-tail:] if tail else [])
        start = offset + sum(len(p) for p in parts[:i])
        out.append((start, start + len(part), prompt + list(pieces.separator) + part))
    return out


@pytest.mark.parametrize("n", [1, 9, 10, 11, 25, 30])
@pytest.mark.parametrize("tail", [0, 3, 8, 12])
def test_reconstruction_chunks_match_the_slow_reference(n, tail):
    ctx = list(range(100, 100 + n))
    got = reconstruction_chunks(torch.tensor([ctx, ctx]), PIECES, offset=5, chunk_size=10, continuation=tail)
    want = slow_chunks(ctx, PIECES, 5, 10, tail)
    assert [(c.start, c.stop) for c in got] == [(s, e) for s, e, _ in want]
    for c, (_, _, ids) in zip(got, want):
        assert c.input_ids.tolist() == [ids, ids]


def test_reconstruction_chunks_cover_the_context_once():
    chunks = reconstruction_chunks(torch.arange(4100)[None], PIECES, offset=7)  # official size 2000
    assert [(c.start, c.stop) for c in chunks] == [(7, 2007), (2007, 4007), (4007, 4107)]
    assert chunks[1].input_ids[0, :2].tolist() == [4, 5] and chunks[1].input_ids[0, 2:10].tolist() == list(range(1992, 2000))


class FakeChatTokenizer:
    """Characters as token ids; a chat template in the style of ChatML."""

    chat_template = "chatml"

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
        assert add_generation_prompt and not tokenize and enable_thinking is False
        (msg,) = messages
        return f"<s>system\nBe helpful.</s>\n<s>{msg['role']}\n{msg['content']}</s>\n<s>assistant\n"


def test_reconstruction_pieces_chat_and_raw():
    tok = FakeChatTokenizer()
    chat = reconstruction_pieces(tok, "chat", "official")
    assert chat.separator == tuple(map(ord, "</s>\n<s>assistant\n"))
    assert chat.first_prompt == tuple(map(ord, FIRST_PROMPT))
    assert chat.later_prompt == tuple(map(ord, LATER_PROMPT["official"])) and LATER_PROMPT["official"].endswith(" ")
    assert reconstruction_pieces(tok, "chat", "kvpress").later_prompt == tuple(map(ord, LATER_PROMPT["kvpress"]))
    assert reconstruction_pieces(tok, "raw").separator == (ord("\n"),)
    ids, prefix = chat_context(tok, "Some text.")
    head = "<s>system\nBe helpful.</s>\n<s>user\n"
    assert prefix == len(head) and "".join(map(chr, ids[0].tolist())) == head + "Some text."


def test_reconstruction_bad_input():
    class NoTemplate(FakeChatTokenizer):
        chat_template = None

    with pytest.raises(KvtrimError, match="chat template"):
        reconstruction_pieces(NoTemplate(), "chat")
    with pytest.raises(KvtrimError, match="mode"):
        reconstruction_pieces(FakeChatTokenizer(), "plain")
    with pytest.raises(KvtrimError, match="style"):
        reconstruction_pieces(FakeChatTokenizer(), "chat", "paper")
    with pytest.raises(KvtrimError, match="chunk_size"):
        reconstruction_chunks(torch.zeros(1, 5, dtype=torch.long), PIECES, chunk_size=0)
    with pytest.raises(KvtrimError, match="tuple of token ids"):
        ReconstructionPieces([1], (2,), (3,))


# ---- scoring -------------------------------------------------------------------------------------
def slow_scores(q, ctx_keys, own_keys, start, stop, sink, scaling=None):
    """Per query, per query head: a softmax over the listed keys, then the max per chunk entry."""
    b, hq, r, d = q.shape
    hkv, n = ctx_keys.shape[1], ctx_keys.shape[2]
    scale = scaling if scaling is not None else 1 / math.sqrt(d)
    sinks = min(sink, start)
    out = torch.zeros(b, hkv, n, dtype=torch.float64)
    for bi in range(b):
        for hi in range(hq):
            kv = hi // (hq // hkv)
            for i in range(r):
                keys = [ctx_keys[bi, kv, j] for j in range(sinks)] + [ctx_keys[bi, kv, j] for j in range(start, stop)]
                keys += [own_keys[bi, kv, j] for j in range(i + 1)]  # causal among reconstruction tokens
                logits = [float(q[bi, hi, i].double() @ k.double()) * scale for k in keys]
                top = max(logits)
                z = sum(math.exp(x - top) for x in logits)
                for j in range(stop - start):
                    p = math.exp(logits[sinks + j] - top) / z
                    out[bi, kv, start + j] = max(out[bi, kv, start + j], p)
    return out


@pytest.mark.parametrize("start,stop,sink", [(4, 13, 4), (0, 7, 4), (2, 15, 4), (6, 20, 0), (5, 9, 3)])
def test_scores_match_per_query_loop(start, stop, sink):
    g = torch.Generator().manual_seed(start * 31 + stop)
    b, hq, hkv, n, r, d = 2, 6, 2, 20, 5, 8
    q = torch.randn(b, hq, r, d, generator=g) * 2
    ctx = torch.randn(b, hkv, n, d, generator=g)
    own = torch.randn(b, hkv, r, d, generator=g)
    got = reconstruction_scores(q, ctx, own, start, stop, sink)
    torch.testing.assert_close(got.double(), slow_scores(q, ctx, own, start, stop, sink), rtol=1e-5, atol=1e-6)
    assert got.dtype == torch.float32 and (got[..., :start] == 0).all() and (got[..., stop:] == 0).all()
    scaled = reconstruction_scores(q, ctx, own, start, stop, sink, scaling=0.3)
    torch.testing.assert_close(scaled.double(), slow_scores(q, ctx, own, start, stop, sink, 0.3), rtol=1e-5, atol=1e-6)


def test_scores_running_max_over_two_chunks():
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, n, d = 1, 4, 2, 24, 8
    ctx = torch.randn(b, hkv, n, d, generator=g)
    qa, own_a = torch.randn(b, hq, 6, d, generator=g), torch.randn(b, hkv, 6, d, generator=g)
    qb, own_b = torch.randn(b, hq, 9, d, generator=g), torch.randn(b, hkv, 9, d, generator=g)
    first = reconstruction_scores(qa, ctx, own_a, 4, 14, 4)
    before = first.clone()
    both = reconstruction_scores(qb, ctx, own_b, 10, 20, 4, scores=first)
    assert torch.equal(first, before)  # pure: the input scores are not modified
    a = slow_scores(qa, ctx, own_a, 4, 14, 4)
    bb = slow_scores(qb, ctx, own_b, 10, 20, 4)
    torch.testing.assert_close(both.double(), torch.maximum(a, bb), rtol=1e-5, atol=1e-6)
    assert not torch.equal(both[..., 10:14], first[..., 10:14])  # the overlap really took a maximum


def test_scores_bad_input():
    q, ctx, own = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(KvtrimError, match="chunk"):
        reconstruction_scores(q, ctx, own, 5, 11, 4)
    with pytest.raises(KvtrimError, match="reconstruction queries"):
        reconstruction_scores(q, ctx, own[:, :, :2], 0, 4, 4)
    with pytest.raises(KvtrimError, match="multiple"):
        reconstruction_scores(torch.randn(1, 3, 3, 8), ctx, own, 0, 4, 4)
    with pytest.raises(KvtrimError, match="scores must be shaped"):
        reconstruction_scores(q, ctx, own, 0, 4, 4, scores=torch.zeros(1, 2, 9))


# ---- selection -----------------------------------------------------------------------------------
def random_scores(seed, sizes=(17, 23, 11), b=2, h=3, ties=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.rand(b, h, n, generator=g) for n in sizes]
    return [(s * 8).floor() / 8 for s in out] if ties else out


def brute_global(scores, k_pool_fn, protected, layerwise):
    """Sort all (layer, head, entry) triples of each batch row: score descending, then layer, head, position."""
    b, h = scores[0].shape[:2]
    masks = [torch.zeros(s.shape, dtype=torch.bool) for s in scores]
    groups = [[i] for i in range(len(scores))] if layerwise else [list(range(len(scores)))]
    for bi in range(b):
        for layers in groups:
            triples = [(float(scores[li][bi, hh, j]), li, hh, j) for li in layers for hh in range(h)
                       for j in range(scores[li].shape[-1])]
            pool = [t for t in triples if t[3] >= protected]
            for _, li, hh, j in triples:
                if j < protected:
                    masks[li][bi, hh, j] = True
            k = k_pool_fn(len(pool), len(triples), len(triples) - len(pool))
            for _, li, hh, j in sorted(pool, key=lambda t: (-t[0], t[1], t[2], t[3]))[:max(k, 0)]:
                masks[li][bi, hh, j] = True
    return masks


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("rounding", ["official", "kvpress"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 0.77])
def test_select_global_matches_brute_force(layerwise, rounding, ties, ratio):
    scores = random_scores(int(ratio * 100) + ties, ties=ties)
    got = select_global(scores, compression_ratio=ratio, protected=2, layerwise=layerwise, rounding=rounding)
    want = brute_global(scores, lambda p, a, pr: kept_in_pool(p, a, pr, ratio, rounding, True), 2, layerwise)
    for g, w in zip(got, want):
        assert g.dtype == torch.bool and torch.equal(g, w)


def test_select_global_budget_and_large_pool():
    # large enough for top_indices' threshold path (n >= 1024)
    scores = random_scores(5, sizes=(700, 500), b=1, h=2, ties=True)
    got = select_global(scores, budget=300, protected=4)
    assert sum(int(m.sum()) for m in got) == 300 * 2 * 2
    want = brute_global(scores, lambda p, a, pr: 300 * 2 * 2 - pr, 4, False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    per_layer = select_global(scores, budget=300, protected=4, layerwise=True)
    assert [int(m.sum()) for m in per_layer] == [600, 600]


def test_official_rule_literally():
    """The official threshold (strictly above the sorted value at int(N*r)-1) on tie-free scores,
    with the system prompt outside the scored range."""
    scores = random_scores(11, b=1)
    protected = 3
    for ratio in (0.1, 0.3, 0.69, 0.9):
        flat = torch.cat([s[0, :, protected:].reshape(-1) for s in scores])
        r = 1 - ratio
        thres = flat.sort(descending=True).values[max(int(len(flat) * r) - 1, 0)]
        got = select_global(scores, compression_ratio=ratio, protected=protected)
        for s, m in zip(scores, got):
            assert torch.equal(m[..., protected:], s[..., protected:] > thres)
            assert m[..., :protected].all()


def test_kvpress_rule_literally():
    """kvpress: sinks get max + 1, then the int(numel * ratio) lowest of everything are evicted."""
    scores = random_scores(12, sizes=(20, 20, 20), b=1)
    for ratio in (0.1, 0.5, 0.69):
        val = torch.stack(scores)  # (layers, 1, heads, n)
        val[..., :4] = val.max() + 1
        pruned = torch.topk(-val.reshape(-1), int(val.numel() * ratio)).indices
        want = torch.ones(val.numel(), dtype=torch.bool)
        want[pruned] = False
        got = select_global(scores, compression_ratio=ratio, protected=4, rounding="kvpress")
        assert torch.equal(torch.stack(got).reshape(-1), want)
        # layerwise: int(heads * n * ratio) lowest per layer
        got = select_global(scores, compression_ratio=ratio, protected=4, rounding="kvpress", layerwise=True)
        for v, m in zip(val, got):
            pruned = torch.topk(-v.reshape(-1), int(v.numel() * ratio)).indices
            want = torch.ones(v.numel(), dtype=torch.bool)
            want[pruned] = False
            assert torch.equal(m.reshape(-1), want)


def test_sinks_always_kept_even_when_lowest():
    scores = random_scores(3)
    for s in scores:
        s[..., :4] = -1.0
    for layerwise in (False, True):
        for rounding in ("official", "kvpress"):
            masks = select_global(scores, compression_ratio=0.9, protected=4, layerwise=layerwise, rounding=rounding)
            assert all(m[..., :4].all() for m in masks)
    assert all((k[..., :4] == torch.arange(4)).all() for k in select_uniform(scores, compression_ratio=0.9, protected=4))


@pytest.mark.parametrize("rounding", ["official", "kvpress"])
@pytest.mark.parametrize("ties", [False, True])
def test_select_uniform_matches_per_head_sort(rounding, ties):
    scores = random_scores(7, ties=ties)
    got = select_uniform(scores, compression_ratio=0.6, protected=2, rounding=rounding)
    for s, kept in zip(scores, got):
        n = s.shape[-1]
        k = kept_in_pool(n - 2, n, 2, 0.6, rounding, threshold=False)
        assert kept.shape == (*s.shape[:2], 2 + k)
        for bi in range(s.shape[0]):
            for hh in range(s.shape[1]):
                order = sorted(range(2, n), key=lambda j: (-float(s[bi, hh, j]), j))[:k]
                assert kept[bi, hh].tolist() == [0, 1] + sorted(order)
    assert [k.shape[-1] for k in select_uniform(scores, budget=9, protected=2)] == [9, 9, 9]


def test_kept_counts():
    assert kept_in_pool(1000, 1004, 4, 0.7, "official", True) == 299  # int(1000 * 0.3) - 1
    assert kept_in_pool(1000, 1004, 4, 0.7, "official", False) == 300
    assert kept_in_pool(1000, 1004, 4, 0.0, "official", True) == 1000
    assert kept_in_pool(1000, 1004, 4, 0.7, "kvpress", True) == 1004 - int(1004 * 0.7) - 4


def test_mask_to_indices():
    mask = torch.tensor([[[True, False, True], [False, False, True]]])
    assert [[t.tolist() for t in row] for row in mask_to_indices(mask)] == [[[0, 2], [2]]]


def test_selection_bad_input():
    s = random_scores(0)
    with pytest.raises(KvtrimError, match="exactly one"):
        select_global(s, compression_ratio=0.5, budget=3)
    with pytest.raises(KvtrimError, match="exactly one"):
        select_uniform(s)
    with pytest.raises(KvtrimError, match="compression_ratio"):
        select_global(s, compression_ratio=1.0)
    with pytest.raises(KvtrimError, match="rounding"):
        select_global(s, compression_ratio=0.5, rounding="paper")
    with pytest.raises(KvtrimError, match="protected"):
        select_global(s, budget=2, protected=4)
    with pytest.raises(KvtrimError, match="differ"):
        select_global([torch.rand(1, 2, 5), torch.rand(1, 3, 5)], compression_ratio=0.5)
    with pytest.raises(KvtrimError, match="layerwise"):
        select_global(s, compression_ratio=0.5, layerwise=1)


# ---- a tiny model end to end --------------------------------------------------------------------
CAPTURED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
HIDDEN: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}


def capture_eager(module, query, key, value, attention_mask, **kwargs):
    """Eager attention that records the post-RoPE queries and the keys it attends to."""
    CAPTURED[module.layer_idx] = (query.detach().clone(), key.detach().clone())
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_tiny_model_reconstruction_end_to_end():
    AttentionInterface.register("kvzip_test_capture", capture_eager)
    AttentionMaskInterface.register("kvzip_test_capture", eager_mask)
    model = tiny_model("llama", attn_implementation="eager", layers=2, q_heads=4, kv_heads=2)
    model.set_attn_implementation("kvzip_test_capture")
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw: HIDDEN.__setitem__(m.layer_idx, (kw["hidden_states"], kw["position_embeddings"])),
        with_kwargs=True) for layer in model.model.layers]
    g = torch.Generator().manual_seed(0)
    prefix, n_ctx = 4, 36
    ids = torch.randint(10, 250, (1, prefix + n_ctx), generator=g)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    n = ids.shape[1]
    stored = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    scores = [None] * len(stored)
    reference = [torch.zeros(1, 2, n, dtype=torch.float64) for _ in stored]
    chunks = reconstruction_chunks(ids[:, prefix:], PIECES, offset=prefix, chunk_size=16)
    assert len(chunks) == 3
    try:
        for chunk in chunks:
            r = chunk.input_ids.shape[1]
            with torch.no_grad():
                model(input_ids=chunk.input_ids, cache=cache, use_cache=True)
            for layer, attn in enumerate(model.model.layers):
                q, k = CAPTURED[layer]
                assert k.shape[2] == n + r and torch.equal(k[:, :, :n], stored[layer][0])
                scores[layer] = reconstruction_scores(q, k[:, :, :n], k[:, :, n:], chunk.start, chunk.stop, prefix,
                                                      scores[layer])
                # independent recomputation of the queries and own keys from the layer's input
                hidden, (cos, sin) = HIDDEN[layer]
                shape = (1, r, -1, 16)
                q2 = attn.self_attn.q_proj(hidden).view(shape).transpose(1, 2)
                k2 = attn.self_attn.k_proj(hidden).view(shape).transpose(1, 2)
                q2, k2 = apply_rotary_pos_emb(q2, k2, cos, sin)
                reference[layer] = torch.maximum(
                    reference[layer], slow_scores(q2.detach(), stored[layer][0], k2.detach(), chunk.start, chunk.stop, prefix))
            cache.crop(-r)  # the reconstruction leaves nothing behind
            assert cache.get_seq_length() == n
    finally:
        for h in hooks:
            h.remove()
    for layer, (k, v) in enumerate(stored):
        assert torch.equal(cache.layers[layer].keys, k) and torch.equal(cache.layers[layer].values, v)
        torch.testing.assert_close(scores[layer].double(), reference[layer], rtol=1e-4, atol=1e-6)
        assert (scores[layer][..., :prefix] == 0).all() and (scores[layer][..., prefix:] > 0).all()
    masks = select_global(scores, compression_ratio=0.5, protected=prefix)
    assert sum(int(m.sum()) for m in masks) == 2 * 2 * prefix + kept_in_pool(2 * 2 * n_ctx, 2 * 2 * n, 16, 0.5,
                                                                           "official", True)


@pytest.mark.integration
def test_smollm2_chat_pieces():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    pieces = reconstruction_pieces(tok, "chat", "kvpress")
    assert tok.decode(list(pieces.separator)) == "<|im_end|>\n<|im_start|>assistant\n"
    ids, prefix = chat_context(tok, "A short document.")
    assert tok.decode(ids[0, prefix:].tolist()) == "A short document."
    assert tok.decode(ids[0, :prefix].tolist()).endswith("<|im_start|>user\n")


# ---- head level through the cache (ragged storage) ------------------------------------------------
class RecordingKVzip(KVzip):
    """KVzip that keeps a copy of the scores its selection sees (the state is cleared after eviction)."""

    def select_layers(self, views):
        self.recorded = [v.state.scores.clone() for v in views]
        return super().select_layers(views)


def _kept_per_head(layer) -> list[list[int]]:
    if layer.is_ragged:
        v = layer.storage.padded()
        return [v.positions[0, h][v.valid[0, h]].tolist() for h in range(v.positions.shape[1])]
    return [layer.positions[0, h].tolist() for h in range(layer.positions.shape[1])]


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))


@pytest.mark.parametrize("variant, layerwise", [("official", False), ("kvpress", False), ("kvpress", True)])
def test_head_level_through_the_cache_keeps_the_global_selection(smollm_tokenizer, variant, layerwise):
    """`level="head"` via `kvtrim.compress`: every layer and head holds exactly what `select_global` keeps
    from the same scores (which do not depend on the level), heads hold different counts, the layers that
    differ are stored ragged with allocated bytes within 2 % of the entries held, and the compressed
    context answers questions (decoding over ragged layers)."""
    import kvtrim

    model = kvtrim.enable(tiny_model("qwen2", q_heads=6, kv_heads=2, layers=3, vocab=49152))
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    params = dict(compression_ratio=0.6, variant=variant, chunk_size=64)
    head = RecordingKVzip(level="head", layerwise=layerwise, **params)
    ctx = kvtrim.compress(model, ids, head, tokenizer=smollm_tokenizer)
    uniform = RecordingKVzip(**params)
    kvtrim.compress(model, ids, uniform, tokenizer=smollm_tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(head.recorded, uniform.recorded))

    masks = select_global(head.recorded, compression_ratio=0.6, protected=4, layerwise=layerwise, rounding=variant)
    layers = [layer for layer in ctx.cache.layers if isinstance(layer, kvtrim.TrimLayer)]
    for layer, mask in zip(layers, masks):
        assert _kept_per_head(layer) == [mask[0, h].nonzero().flatten().tolist() for h in range(mask.shape[1])]
        assert layer.lengths.tolist() == mask.sum(-1).tolist()
    assert any(layer.is_ragged for layer in layers)
    stats = ctx.stats()
    assert stats.bytes_allocated <= 1.02 * stats.bytes_ideal
    assert stats.bytes_ideal < 0.5 * stats.bytes_full  # 60 % of the context's entries are gone, really
    question = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(4))
    first = ctx.generate(question, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert first.shape == (1, 4)
    assert [layer.lengths.tolist() for layer in layers] == [m.sum(-1).tolist() for m in masks]  # ctx unchanged
    assert torch.equal(ctx.generate(question, max_new_tokens=4, do_sample=False, pad_token_id=0), first)
