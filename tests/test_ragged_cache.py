"""Ragged cache layers inside `TrimCache`: a method that keeps unequal numbers of entries per (sequence,
kv_head) row switches the layer to ragged storage; the model's outputs must equal a full cache whose
attention hides exactly the evicted entries per head (a slow masked reference written here), and the
bytes the cache's tensors hold must stay within 1.02x the ideal bytes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_model
from transformers import AttentionInterface, DynamicCache

from kvtrim import TrimCache, enable
from kvtrim.methods.base import EvictionMethod, Phase

REF = "kvtrim_test_masked_reference"


@dataclass(kw_only=True)
class Uneven(EvictionMethod):
    """Keeps a different subset per head: at the prompt's end drops positions with `(pos + head) % 3 == 0`;
    every append drops `(pos * (head + 1)) % 5 == 1`; every third decode step drops the oldest entry of
    head 0. Never a row's newest entry. Records what it evicted and when (`view.seen`)."""

    name = "test_uneven"

    def __post_init__(self):
        super().__post_init__()
        self.log: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (layer, seen, positions, dropped)

    def _drop(self, view, dropped):
        valid = view.valid if view.valid is not None else torch.ones_like(view.positions, dtype=torch.bool)
        lengths = valid.sum(-1, keepdim=True)
        newest = torch.arange(valid.shape[-1]) == lengths - 1
        dropped = dropped & valid & ~newest
        if not dropped.any():
            return None
        self.log.append((view.layer_idx, view.seen, view.positions.clone(), dropped.clone()))
        return valid & ~dropped

    def on_prompt_end(self, view):
        heads = torch.arange(view.kv_heads)[None, :, None]
        return self._drop(view, (view.positions + heads) % 3 == 0)

    def on_update(self, view):
        heads = torch.arange(view.kv_heads)[None, :, None]
        if view.phase is Phase.APPEND:
            return self._drop(view, (view.positions * (heads + 1)) % 5 == 1)
        if view.phase is Phase.DECODE and view.seen % 3 == 0:
            valid = view.valid if view.valid is not None else torch.ones_like(view.positions, dtype=torch.bool)
            first = valid.long().argmax(-1, keepdim=True)
            oldest = torch.zeros_like(valid).scatter(-1, first, True) & (heads == 0)
            return self._drop(view, oldest)
        return None


def hidden_from(log, layer_idx: int, b: int, h: int, n: int) -> torch.Tensor:
    """`(b, h, n)`: the first query position that no longer sees each key position (a big number: never)."""
    out = torch.full((b, h, n), 1 << 30)
    for layer, seen, positions, dropped in log:
        if layer != layer_idx:
            continue
        for bi, hi, j in dropped.nonzero().tolist():
            p = int(positions[bi, hi, j])
            out[bi, hi, p] = min(int(out[bi, hi, p]), seen)
    return out


def masked_reference_attention(hidden_by_layer):
    """Eager attention over the full cache, each KV head hiding the entries evicted from its row."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, hq, q, d = query.shape
        hkv, n = key.shape[1], key.shape[2]
        g = hq // hkv
        scale = scaling if scaling is not None else d ** -0.5
        qpos = torch.arange(n - q, n)  # full cache, no padding: the new tokens are the last n
        kpos = torch.arange(n)
        hidden = hidden_by_layer[module.layer_idx][:, :, :n]  # (b, hkv, n)
        visible = (kpos[None, None, None, :] <= qpos[None, None, :, None]) & (
            hidden[:, :, None, :] > qpos[None, None, :, None])  # (b, hkv, q, n)
        visible = visible.repeat_interleave(g, dim=1)
        k = key.repeat_interleave(g, dim=1)
        v = value.repeat_interleave(g, dim=1)
        logits = (query @ k.transpose(-1, -2)) * scale
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        return (probs @ v).transpose(1, 2).contiguous(), probs

    return attention


def run_steps(model, cache, prompt, append, decode_ids):
    """Prompt, greedy-free fixed decode tokens, then an append, then more decode tokens: every logits."""
    logits = []
    with torch.no_grad():
        logits.append(model(prompt, cache=cache).logits)
        for t in decode_ids[:4]:
            logits.append(model(t.view(1, 1).expand(prompt.shape[0], 1), cache=cache).logits)
        logits.append(model(append, cache=cache).logits)
        for t in decode_ids[4:]:
            logits.append(model(t.view(1, 1).expand(prompt.shape[0], 1), cache=cache).logits)
    return logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_ragged_layers_match_a_per_head_masked_full_cache(kind, batch):
    kwargs = {} if kind == "llama" else {"q_heads": 6, "kv_heads": 2}
    model = enable(tiny_model(kind, **kwargs))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (batch, 23), generator=g)
    append = torch.randint(0, 256, (batch, 5), generator=g)
    decode_ids = torch.randint(0, 256, (9,), generator=g)

    method = Uneven()
    cache = TrimCache(method, config=model.config)
    got = run_steps(model, cache, prompt, append, decode_ids)
    layers = cache.trim_layers()
    assert all(layer.is_ragged for layer in layers)
    n_total = 23 + 5 + 9
    for layer in layers:
        lengths = layer.lengths
        assert lengths.shape == (batch, model.config.num_key_value_heads)
        assert len(set(lengths.flatten().tolist())) > 1  # rows really differ
        # the rows hold exactly the positions the method did not evict
        hidden = hidden_from(method.log, layer.layer_idx, batch, lengths.shape[1], n_total)
        pos = layer.storage.positions
        for bi in range(batch):
            for hi in range(lengths.shape[1]):
                expect = [p for p in range(n_total) if hidden[bi, hi, p] > n_total]
                assert pos[bi, hi, : lengths[bi, hi]].tolist() == expect

    hidden_by_layer = {layer.layer_idx: hidden_from(method.log, layer.layer_idx, batch, 2, n_total) for layer in layers}
    AttentionInterface.register(REF, masked_reference_attention(hidden_by_layer))
    ref_model = tiny_model(kind, **kwargs)
    ref_model.set_attn_implementation(REF)
    want = run_steps(ref_model, DynamicCache(), prompt, append, decode_ids)
    for step, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=f"step {step}")


def test_allocated_bytes_stay_within_two_percent_of_ideal():
    model = enable(tiny_model("llama"))
    prompt = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))
    cache = TrimCache(Uneven(), config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache)
        for step in range(40):
            model(torch.full((2, 1), step), cache=cache)
            stats = cache.stats()
            measured = sum(t.untyped_storage().nbytes() for layer in cache.trim_layers() for t in layer.kv_tensors())
            assert stats.bytes_allocated == measured
            ideal = sum(int(layer.lengths.sum()) * 16 * 2 * 4 for layer in cache.trim_layers())
            assert stats.bytes_ideal == ideal
            assert measured <= 1.02 * ideal
    assert stats.ragged_layers == [0, 1]
    assert stats.lengths_per_layer[0] == cache.layers[0].lengths.tolist()


def _ragged_after_one_step(seed: int):
    """`(model, cache)`: a batch of two 20-token prompts and one decode step under `Uneven` (ragged layers)."""
    model = enable(tiny_model("llama"))
    prompt = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(seed))
    cache = TrimCache(Uneven(), config=model.config)
    with torch.no_grad():
        model(prompt, cache=cache)
        model(torch.full((2, 1), 3), cache=cache)
    return model, cache


def test_copy_reorder_and_reset_of_ragged_layers():
    model, cache = _ragged_after_one_step(seed=0)
    with torch.no_grad():
        copy = cache.copy()
        lengths = [layer.lengths for layer in cache.trim_layers()]
        a = model(torch.full((2, 1), 4), cache=copy).logits
        assert all(torch.equal(layer.lengths, n) for layer, n in zip(cache.trim_layers(), lengths))  # independent
        b = model(torch.full((2, 1), 4), cache=cache).logits
        torch.testing.assert_close(a, b, atol=0, rtol=0)

        swapped = cache.copy()
        swapped.reorder_cache(torch.tensor([1, 0]))
        for layer, before in zip(swapped.trim_layers(), cache.trim_layers()):
            assert torch.equal(layer.lengths, before.lengths.flip(0))
            mine, theirs = layer.storage.padded(), before.storage.padded()
            assert torch.equal(mine.keys[mine.valid], theirs.keys.flip(0)[theirs.valid.flip(0)])
        c = model(torch.full((2, 1), 5), cache=swapped).logits
        d = model(torch.full((2, 1), 5), cache=cache).logits
        torch.testing.assert_close(c, d.flip(0), atol=1e-6, rtol=1e-6)

        cache.reset()
        assert all(not layer.is_ragged for layer in cache.trim_layers())


def test_equal_keeps_stay_dense():
    @dataclass(kw_only=True)
    class EveryOther(EvictionMethod):
        name = "test_every_other"

        def on_prompt_end(self, view):
            return view.positions % 2 == 0  # a mask, but equal counts in every row

    model = enable(tiny_model("llama"))
    cache = TrimCache(EveryOther(), config=model.config)
    with torch.no_grad():
        model(torch.arange(10)[None], cache=cache)
        model(torch.tensor([[1]]), cache=cache)
    layer = cache.layers[0]
    assert not layer.is_ragged and layer.keys.shape[2] == 6
    assert layer.positions[0, 0].tolist() == [0, 2, 4, 6, 8, 10]


def test_a_ragged_layer_under_stock_attention_is_a_one_line_error():
    from kvtrim import AdaKV, KNorm, KvtrimError

    model = tiny_model("llama")  # stock SDPA: cannot mask rows of different lengths
    cache = TrimCache(AdaKV(KNorm(compression_ratio=0.5)), config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0)), cache=cache)
        with pytest.raises(KvtrimError, match="needs kvtrim's attention function"):
            model(torch.tensor([[1]]), cache=cache)


def test_batch_repeat_and_select_of_ragged_layers():
    _, cache = _ragged_after_one_step(seed=5)
    before = [(layer.lengths, layer.storage.padded()) for layer in cache.trim_layers()]
    cache.batch_repeat_interleave(2)
    for layer, (lengths, view) in zip(cache.trim_layers(), before):
        assert torch.equal(layer.lengths, lengths.repeat_interleave(2, dim=0))
        mine = layer.storage.padded()
        assert torch.equal(mine.keys[mine.valid], view.keys.repeat_interleave(2, 0)[view.valid.repeat_interleave(2, 0)])
    cache.batch_select_indices(torch.tensor([3, 0]))
    for layer, (lengths, _) in zip(cache.trim_layers(), before):
        assert torch.equal(layer.lengths, lengths[[1, 0]])
        assert layer.storage.allocated_bytes() <= 1.02 * layer.storage.ideal_bytes()
