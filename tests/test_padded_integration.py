"""Padded batches on the real model (issue #11, "what it must show"): a left-padded batch of 8 prompts of
300 to 2,000 tokens through the stock `model.generate` with a `TrimCache` gives, for every sequence, the
greedy tokens and the stored positions of every layer it gives alone (batch 1, unpadded), for eight
methods sized to evict at the prompt and again while decoding (where the method does), float32.

The reference is the obvious one: each prompt run alone through the same `generate` (computed once per
method). Each method's cost is the padded batch (8 rows × the longest prompt, pads included, through
kvtrim's ragged attention) plus the eight prompts alone; the lengths are spread over 300..2,000 with one
long prompt, so the alone runs cost about a quarter of the batch. Marked `slow` (minutes on 2 CPU threads,
`benchmarks/padded/README.md`): `make test-slow` runs it, `make test` does not.
"""

from __future__ import annotations

import pytest
import torch
from test_padded import pad, rows
from transformers import LogitsProcessor, LogitsProcessorList

import kvtrim
from kvtrim.eval.haystack import prose_sentences

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LENGTHS = (2000, 300, 1100, 420, 340, 650, 380, 520)  # one long prompt, the rest spread over 300..1,100
NEW = 5  # forward 0 is the prompt, 1 ends it (one-shot methods), 2..4 are plain decode steps
BUDGET = 128  # below the shortest prompt: every sizable method evicts every sequence at the prompt

# (name, method, evicts at the prompt, evicts while decoding)
METHODS = [
    ("full", kvtrim.FullCache(), False, False),
    ("lagkv", kvtrim.LagKV(sink_size=4, lag_size=4), True, True),  # a partition completes every 4 tokens
    ("keydiff", kvtrim.KeyDiff(budget=BUDGET, block_size=2), True, True),  # block eviction at budget + 2
    ("snapkv", kvtrim.SnapKV(budget=BUDGET, window=16), True, False),  # one-shot
    ("streaming", kvtrim.StreamingLLM(budget=BUDGET, sink_size=4), True, True),
    ("tova", kvtrim.TOVA(budget=BUDGET), True, True),
    ("h2o", kvtrim.H2O(budget=BUDGET), True, True),
    ("lazyeviction", kvtrim.LazyEviction(budget=BUDGET, window=2), False, True),  # every 2 decode steps
]


@pytest.fixture(scope="module")
def seqs(smollm):
    """Eight distinct prose prompts (`kvtrim.eval.haystack`, a different seed each) cut to `LENGTHS`."""
    _, tok = smollm
    out = []
    for i, n in enumerate(LENGTHS):
        ids = tok(" ".join(prose_sentences(400, seed=i)), return_tensors="pt").input_ids[0]
        assert len(ids) >= n
        out.append(ids[:n])
    return out


class Timeline(LogitsProcessor):
    """Called by `generate` after each forward: per layer, `(evictions so far, stored per sequence (KV head 0))`."""

    def __init__(self, cache: kvtrim.TrimCache):
        self.cache, self.steps = cache, []

    def __call__(self, input_ids, scores):
        self.steps.append([(layer.evictions, layer.lengths[:, 0].tolist()) for layer in self.cache.trim_layers()])
        return scores


def greedy(model, ids, mask, method, pad_id):
    cache = kvtrim.TrimCache(method, config=model.config)
    timeline = Timeline(cache)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=pad_id, logits_processor=LogitsProcessorList([timeline]))
    return out[:, ids.shape[-1]:], cache, timeline.steps


def assert_evicted_as_designed(steps, lengths, at_prompt, while_decoding, name):
    """`steps[k][layer] = (evictions, stored per sequence)` after forward k (0: the prompt)."""
    assert len(steps) == NEW
    for layer_idx in range(len(steps[0])):
        evictions = [step[layer_idx][0] for step in steps]
        stored = steps[1][layer_idx][1]  # the prompt has ended, one decode token appended
        if at_prompt:
            assert all(s < n for s, n in zip(stored, lengths)), (name, layer_idx, stored)
        else:
            assert stored == [n + 1 for n in lengths], (name, layer_idx, stored)
        decoded = [evictions[k] > evictions[k - 1] for k in range(2, NEW)]
        assert any(decoded) == while_decoding, (name, layer_idx, evictions)
    if not at_prompt and not while_decoding:
        assert all(e == 0 for step in steps for e, _ in step), name


@pytest.mark.parametrize("name, method, at_prompt, while_decoding", METHODS, ids=[m[0] for m in METHODS])
def test_padded_batch_of_8_equals_each_prompt_alone(smollm, seqs, name, method, at_prompt, while_decoding):
    model, tok = smollm
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids, mask = pad(seqs, "left")
    ids = ids.masked_fill(mask == 0, pad_id)
    tokens, cache, steps = greedy(model, ids, mask, method, pad_id)
    assert_evicted_as_designed(steps, LENGTHS, at_prompt, while_decoding, name)
    for layer in cache.trim_layers():
        assert layer.is_ragged and layer.per_sequence
    for i, s in enumerate(seqs):
        alone_tokens, alone, alone_steps = greedy(model, s[None], torch.ones(1, len(s), dtype=torch.long), method,
                                                  pad_id)
        assert torch.equal(tokens[i], alone_tokens[0]), (name, i, tokens[i].tolist(), alone_tokens[0].tolist())
        for lb, la in zip(cache.trim_layers(), alone.trim_layers()):
            assert rows(lb)[i] == rows(la)[0], (name, i, lb.layer_idx)
        assert [step[0][1][i] for step in steps] == [step[0][1][0] for step in alone_steps], (name, i)
