"""Attention over ragged storage against a masked full-cache reference (float32)."""

from __future__ import annotations

import pytest
import torch

from kvtrim.methods.base import KvtrimError
from kvtrim.ragged_attention import ragged_attention, ragged_attention_with_probabilities
from kvtrim.storage import RaggedKV


class FullCache:
    """Every token ever seen, dense `(b, kv_heads, T, d)`, with a mask of what is still present.

    Pads are never present; evicted entries stop being present. The reference attention is a plain
    softmax over the whole cache with a mask hiding absent entries and entries after the query."""

    def __init__(self, b, h, d):
        self.k = torch.zeros(b, h, 0, d)
        self.v = torch.zeros(b, h, 0, d)
        self.pos = torch.zeros(b, 0, dtype=torch.long)
        self.present = torch.zeros(b, h, 0, dtype=torch.bool)

    def append(self, k, v, pos, valid):
        self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        self.pos = torch.cat([self.pos, pos], 1)
        self.present = torch.cat([self.present, valid[:, None, :].expand(-1, k.shape[1], -1)], 2)

    def evict(self, store: RaggedKV, keep):
        """Mirror `store.evict(keep)`: absent = the stored entries (in row order) that `keep` drops."""
        b, h, _ = self.present.shape
        for bi in range(b):
            for hi in range(h):
                where = self.present[bi, hi].nonzero().flatten()
                n = int(store.lengths[bi, hi])
                assert len(where) == n
                self.present[bi, hi, where[~keep[bi, hi, :n]]] = False

    def attend(self, query, qpos, qvalid, scale, softcap=None):
        """float64 reference: `(b, q, hq, d)` output and `(b, hq, q, T)` probabilities."""
        b, hq, q, d = query.shape
        g = hq // self.k.shape[1]
        k = self.k.double().repeat_interleave(g, 1)
        v = self.v.double().repeat_interleave(g, 1)
        logits = query.double() @ k.transpose(-1, -2) * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        mask = self.present.repeat_interleave(g, 1)[:, :, None, :] & (self.pos[:, None, None, :] <= qpos[:, None, :, None])
        mask = mask & qvalid[:, None, :, None]
        probs = logits.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
        return (probs @ v).transpose(1, 2), probs


def to_view_order(store: RaggedKV, cache: FullCache, probs_full):
    """Reference probabilities `(b, hq, q, T)` rearranged onto the storage's padded view `(b, hq, q, W)`."""
    b, hq, q, _ = probs_full.shape
    g = hq // store.kv_heads
    out = torch.zeros(b, hq, q, store.width, dtype=probs_full.dtype)
    for bi in range(b):
        for h in range(hq):
            where = cache.present[bi, h // g].nonzero().flatten()
            out[bi, h, :, : len(where)] = probs_full[bi, h, :, where]
    return out


def scenario(b, hq, hkv, d=16, prompt=24, side="left", seed=0, decode=6, block=5, softcap=None):
    """A padded prompt, a padded multi-token block, then decode steps, with random per-row evictions
    (different sizes, one row emptied) between steps; checks every step against the full-cache reference."""
    g = torch.Generator().manual_seed(seed)
    scale = d ** -0.5
    lens = torch.randint(1, prompt + 1, (b,), generator=g)
    lens[0] = prompt
    store = RaggedKV.empty(b, hkv, d)
    cache = FullCache(b, hkv, d)
    next_pos = torch.zeros(b, dtype=torch.long)
    steps = [prompt, block] + [1] * decode
    for step, q in enumerate(steps):
        valid = torch.zeros(b, q, dtype=torch.bool)
        for bi in range(b):
            n = int(lens[bi]) if step == 0 else (q if step != 1 else int(torch.randint(1, q + 1, (1,), generator=g)))
            if side == "left":
                valid[bi, q - n:] = True
            else:
                valid[bi, :n] = True
        pos = next_pos[:, None] + (valid.long().cumsum(-1) - 1).clamp(min=0)
        next_pos = next_pos + valid.sum(-1)
        k, v = torch.randn(b, hkv, q, d, generator=g), torch.randn(b, hkv, q, d, generator=g)
        query = torch.randn(b, hq, q, d, generator=g)
        store.append(k, v, pos, valid)
        cache.append(k, v, pos, valid)
        want, want_probs = cache.attend(query, pos, valid, scale, softcap)
        got = ragged_attention(query, store, pos, valid, scaling=scale, softcap=softcap)
        assert got.shape == (b, q, hq, d)
        assert torch.allclose(got, want.float(), atol=2e-5), f"step {step}: {(got - want).abs().max()}"
        assert (got.transpose(1, 2)[~valid[:, None, :].expand(b, hq, q)] == 0).all()  # pad queries: 0
        out, probs = ragged_attention_with_probabilities(query, store, pos, valid, scaling=scale, softcap=softcap)
        assert probs.shape == (b, hq, q, store.width)
        assert torch.allclose(probs, to_view_order(store, cache, want_probs).float(), atol=1e-6)
        assert torch.allclose(out, want.float(), atol=2e-5)
        # evict: a random fraction per row, different across rows; at step 1 row (b-1, 0) is emptied
        keep = store.valid & (torch.rand(b, hkv, store.width, generator=g) >= 0.5 * torch.rand(b, hkv, 1, generator=g))
        if step == 1:
            keep[b - 1, 0] = False
        cache.evict(store, keep)
        store.evict(keep)
    assert store.lengths.min() >= 0 and not torch.equal(store.lengths, store.lengths[:1, :1].expand_as(store.lengths))


@pytest.mark.parametrize("hq,hkv", [(1, 1), (4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("side", ["left", "right"])
def test_matches_masked_full_cache(hq, hkv, side):
    scenario(3, hq, hkv, side=side, seed=hq * 10 + hkv)


def test_batch_of_rows_of_very_different_lengths():
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, d = 2, 6, 3, 8
    store, cache = RaggedKV.empty(b, hkv, d), FullCache(b, hkv, d)
    k, v = torch.randn(b, hkv, 300, d, generator=g), torch.randn(b, hkv, 300, d, generator=g)
    pos, valid = torch.arange(300).expand(b, 300), torch.ones(b, 300, dtype=torch.bool)
    store.append(k, v, pos, valid)
    cache.append(k, v, pos, valid)
    keep = store.valid.clone()
    keep[0, 1, 2:] = False  # 2 entries
    keep[1, 2, :] = False  # 0 entries: only the new token will be visible
    keep[1, 0, :290] = False  # 10 entries
    cache.evict(store, keep)
    store.evict(keep)
    assert sorted(store.lengths.flatten().tolist()) == [0, 2, 10, 300, 300, 300]
    nk, nv = torch.randn(b, hkv, 1, d, generator=g), torch.randn(b, hkv, 1, d, generator=g)
    npos, nvalid = torch.full((b, 1), 300), torch.ones(b, 1, dtype=torch.bool)
    store.append(nk, nv, npos, nvalid)
    cache.append(nk, nv, npos, nvalid)
    query = torch.randn(b, hq, 1, d, generator=g)
    want, want_probs = cache.attend(query, npos, nvalid, 0.3)
    got = ragged_attention(query, store, npos, scaling=0.3)
    assert torch.allclose(got, want.float(), atol=2e-5)
    # the empty row's query heads see only their own new entry: output = its value
    assert torch.allclose(got[1, 0, 4:6], nv[1, 2, 0].expand(2, d), atol=1e-6)
    out, probs = ragged_attention_with_probabilities(query, store, npos, scaling=0.3)
    assert torch.allclose(probs, to_view_order(store, cache, want_probs).float(), atol=1e-6)
    # output == probs @ V, in the grouped layout the function uses
    view = store.padded()
    again = (probs.view(b, hkv, 2, store.width) @ view.values).view(b, hq, 1, d).transpose(1, 2)
    assert torch.equal(out, again)


def test_softcap_uses_the_explicit_path():
    scenario(2, 4, 2, seed=3, decode=2, softcap=1.5)


def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                                causal=False, **kwargs):
    """flash-attn's documented varlen semantics, in plain torch: sequence i has queries
    q[cu_q[i]:cu_q[i+1]] and keys k[cu_k[i]:cu_k[i+1]]; with causal=True the mask is aligned to the
    bottom-right corner (query r of sq sees keys j <= sk - sq + r); query heads share KV heads in groups."""
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        sq, sk = q1 - q0, k1 - k0
        if sq == 0:
            continue
        g = q.shape[1] // k.shape[1]
        kk = k[k0:k1].repeat_interleave(g, 1).transpose(0, 1)  # (H, sk, d)
        vv = v[k0:k1].repeat_interleave(g, 1).transpose(0, 1)
        logits = q[q0:q1].transpose(0, 1) @ kk.transpose(-1, -2) * softmax_scale  # (H, sq, sk)
        if causal:
            allowed = torch.arange(sk)[None, :] <= (sk - sq + torch.arange(sq))[:, None]
            logits = logits.masked_fill(~allowed, float("-inf"))
        out[q0:q1] = (logits.softmax(-1) @ vv).transpose(0, 1)
    return out


@pytest.mark.parametrize("side", ["left", "right"])
def test_flash_varlen_packing_against_a_plain_varlen_kernel(monkeypatch, side):
    """The flash path's packing (rows = (sequence, kv_head), group heads, valid queries, scatter back) on
    CPU, with flash-attn's documented varlen semantics written in torch in place of the CUDA kernel: the
    packing is tested here, the kernel itself is not (no GPU, flash-attn not installed)."""
    import sys
    import types

    from kvtrim import ragged_attention as ra

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_flash_attn_varlen_func))
    g = torch.Generator().manual_seed(11)
    b, hq, hkv, d, q = 3, 6, 2, 8, 4
    store = RaggedKV.from_dense(torch.randn(b, hkv, 20, d, generator=g), torch.randn(b, hkv, 20, d, generator=g))
    keep = torch.rand(b, hkv, 20, generator=g) < 0.5
    keep[2, 1] = False  # an empty row
    store.evict(keep)
    valid = torch.ones(b, q, dtype=torch.bool)
    if side == "left":
        valid[1, :2] = False
        valid[2, :3] = False
    else:
        valid[1, 3:] = False
        valid[2, 1:] = False
    pos = 20 + (valid.long().cumsum(-1) - 1).clamp(min=0)
    store.append(torch.randn(b, hkv, q, d, generator=g), torch.randn(b, hkv, q, d, generator=g), pos, valid)
    query = torch.randn(b, hq, q, d, generator=g).transpose(2, 3).contiguous().transpose(2, 3)  # non-contiguous
    want = ragged_attention(query, store, pos, valid, scaling=0.4, backend="sdpa")
    got = ra._flash_varlen(query, store, valid, 0.4, None)
    assert torch.allclose(got, want, atol=1e-5)


def test_bad_arguments():
    store = RaggedKV.from_dense(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(KvtrimError, match="multiple of KV heads"):
        ragged_attention(torch.randn(1, 3, 1, 8), store, torch.tensor([[2]]))
    with pytest.raises(KvtrimError, match="query_positions"):
        ragged_attention(q, store, torch.tensor([2]))
    with pytest.raises(KvtrimError, match="query_valid"):
        ragged_attention(q, store, torch.tensor([[2]]), torch.tensor([[1]]))
    with pytest.raises(KvtrimError, match="unknown ragged attention backend"):
        ragged_attention(q, store, torch.tensor([[2]]), backend="triton")
    with pytest.raises(KvtrimError, match="flash backend needs"):
        ragged_attention(q, store, torch.tensor([[2]]), backend="flash")
