"""Padded batches (issue #11 item 3): a left-padded batch through the stock `model.generate` with a
`TrimCache` equals each sequence run alone, with pads never stored and each sequence evicted by its own
counts. The reference is the obvious one: the same method on each prompt alone, batch size 1, unpadded.
(Every registered method: tests/test_conformance.py; the real model: tests/test_padded_integration.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvtrim
from kvtrim.methods.base import kept_count

VOCAB = 512
LENGTHS = (150, 90, 121)
NEW = 6


@pytest.fixture(scope="module")
def model():
    return kvtrim.enable(tiny_model("qwen2", q_heads=6, kv_heads=2, layers=2, vocab=VOCAB))


def prompts(lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def pad(seqs: list[torch.Tensor], side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` `(batch, longest)` with pad id 0 on `side`."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


def greedy(model, ids, mask, method, new=NEW):
    cache = kvtrim.TrimCache(method, config=model.config)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[:, ids.shape[-1]:], cache


def rows(layer) -> list:
    """`[batch][kv_head]` lists of the stored positions of a layer, dense or ragged."""
    if layer.is_ragged:
        positions, lengths = layer.storage.positions, layer.lengths
        return [[positions[b, h, : lengths[b, h]].tolist() for h in range(lengths.shape[1])]
                for b in range(lengths.shape[0])]
    return layer.kept_positions().tolist()  # sorted, whatever the storage order (in-place decoding)


def assert_each_alone(model, seqs, method, side="left", new=NEW):
    ids, mask = pad(seqs, side)
    tokens, cache = greedy(model, ids, mask, method, new)
    for i, s in enumerate(seqs):
        alone_tokens, alone = greedy(model, s[None], torch.ones(1, len(s), dtype=torch.long), method, new)
        assert torch.equal(tokens[i], alone_tokens[0]), (method.describe(), i)
        for lb, la in zip(cache.trim_layers(), alone.trim_layers()):
            assert rows(lb)[i] == rows(la)[0], (method.describe(), i, lb.layer_idx)
    return cache


@pytest.mark.parametrize("method", [kvtrim.FullCache(), kvtrim.SnapKV(budget=60, window=8),
                                    kvtrim.SnapKV(compression_ratio=0.5, window=8)], ids=lambda m: m.label())
def test_left_padded_generate_equals_each_alone(model, method):
    cache = assert_each_alone(model, prompts(), method)
    for layer in cache.trim_layers():
        assert layer.per_sequence and layer.is_ragged
        stored = layer.storage.positions
        assert bool((stored[layer.storage.valid] >= 0).all())  # positions are each sequence's own, from 0


def test_pads_are_never_stored_and_memory_stays_within_2_percent(model):
    seqs = prompts()
    ids, mask = pad(seqs)
    _, cache = greedy(model, ids, mask, kvtrim.FullCache())
    for layer in cache.trim_layers():  # the full cache: exactly each sequence's real tokens (the last
        # generated token is never fed back)
        assert layer.lengths[:, 0].tolist() == [len(s) + NEW - 1 for s in seqs]
        assert [r[0] for r in rows(layer)] == [list(range(len(s) + NEW - 1)) for s in seqs]
    stats = cache.stats()
    assert stats.bytes_allocated <= 1.02 * stats.bytes_ideal
    assert stats.compression_ratio == 0.0  # pads are not counted as removed tokens


def test_compression_ratio_applies_to_each_sequence_own_prompt(model):
    seqs = prompts()
    ids, mask = pad(seqs)
    _, cache = greedy(model, ids, mask, kvtrim.KNorm(compression_ratio=0.5), new=2)
    for layer in cache.trim_layers():
        # the prompt compressed at the first decode step (its own length), then that step's token
        assert layer.lengths[:, 0].tolist() == [kept_count(len(s), 0.5) + 1 for s in seqs]
    stats = cache.stats()
    assert stats.bytes_allocated <= 1.02 * stats.bytes_ideal


def test_right_padded_prefill_stores_only_real_tokens(model):
    """Right padding, one prefill forward: the pads at the end are not stored, each sequence keeps its
    own real tokens, and the kept sets equal the method's on each prompt alone."""
    seqs = prompts()
    method = kvtrim.SnapKV(compression_ratio=0.5, window=8)
    ids, mask = pad(seqs, "right")
    cache = kvtrim.TrimCache(method, config=model.config)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=cache).logits
    cache.end_prompt()
    for i, s in enumerate(seqs):
        alone = kvtrim.TrimCache(method, config=model.config)
        with torch.no_grad():
            want = model(s[None], cache=alone).logits
        alone.end_prompt()
        torch.testing.assert_close(logits[i, : len(s)], want[0])
        for lb, la in zip(cache.trim_layers(), alone.trim_layers()):
            assert rows(lb)[i] == rows(la)[0]


# ---- compress once, a padded batch ------------------------------------------------------------------------
@pytest.mark.parametrize("method", [kvtrim.SnapKV(compression_ratio=0.5, window=8),
                                    kvtrim.KeyDiff(budget=40, block_size=32),
                                    kvtrim.LagKV(sink_size=4, lag_size=16)], ids=lambda m: m.label())
def test_compress_a_padded_batch_then_questions_of_different_lengths(model, method):
    """A list of contexts compressed at once (block-wise methods: each context's own blocks), then
    questions of different lengths: each sequence's answer and kept entries equal its compression alone."""
    contexts = prompts((150, 70, 121), seed=1)
    questions = prompts((5, 9, 3), seed=2)
    ctx = kvtrim.compress(model, contexts, method)
    before = ctx.stats()
    answers = ctx.generate(questions, max_new_tokens=NEW)
    assert ctx.stats() == before  # asking leaves the compressed contexts unchanged
    assert before.bytes_allocated <= 1.02 * before.bytes_ideal
    for i, (c, q) in enumerate(zip(contexts, questions)):
        alone = kvtrim.compress(model, c[None], method)
        for lb, la in zip(ctx.cache.trim_layers(), alone.cache.trim_layers()):
            assert rows(lb)[i] == rows(la)[0], (method.describe(), i)
        torch.testing.assert_close(ctx.logits[i], alone.logits[0])
        assert torch.equal(answers[i], alone.generate(q[None], max_new_tokens=NEW)[0]), (method.describe(), i)


def test_compress_takes_a_right_padded_tensor_and_its_mask(model):
    contexts = prompts((60, 41), seed=3)
    ids, mask = pad(contexts, "right")
    method = kvtrim.KNorm(compression_ratio=0.5)
    from_tensor = kvtrim.compress(model, ids, method, attention_mask=mask)
    from_list = kvtrim.compress(model, contexts, method)
    assert torch.equal(from_tensor.context_ids, from_list.context_ids)
    for a, b in zip(from_tensor.cache.trim_layers(), from_list.cache.trim_layers()):
        assert rows(a) == rows(b)


def test_padded_batch_refusals_are_one_line(model):
    stock = tiny_model("qwen2", q_heads=6, kv_heads=2, layers=2, vocab=VOCAB)  # no kvtrim attention
    with pytest.raises(kvtrim.KvtrimError, match="needs kvtrim's attention"):
        kvtrim.compress(stock, prompts(), kvtrim.KNorm(budget=20))
    ctx = kvtrim.compress(model, prompts()[0][None], kvtrim.KNorm(budget=20))  # an unpadded context
    with pytest.raises(kvtrim.KvtrimError, match="need a padded batch of contexts"):
        ctx.generate([torch.tensor([1, 2]), torch.tensor([3])])
    ids, mask = pad(prompts())
    cache = kvtrim.TrimCache(kvtrim.KNorm(budget=20), config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache)  # no padding in the first forward: a dense batch
        with pytest.raises(kvtrim.KvtrimError, match="padding appeared after the first forward"):
            model(ids[:, -1:], attention_mask=torch.cat([mask, torch.tensor([[1], [0], [1]])], -1)[:, 1:], cache=cache)
