"""`StoredCounts` (the scheduler's counts, no vLLM needed): counting by the schedule (no keys) says the same
as the method run on stand-in keys, forward by forward: which forwards are due and how many entries are
discarded after each; prompts read in blocks are told block by block whatever vLLM's chunks; the peaks the
scheduler admits by and the KV-cache spec reports, against `TrimCache` and brute force."""

import pytest
import torch

from kvtrim.cache import TrimCache
from kvtrim.methods.base import KvtrimError, Phase, kept_count
from kvtrim.specs import parse_method_spec
from kvtrim.vllm.planning import (StoredCounts, block_end, forward_steps, longest_peak, plan_forward, prompt_block,
                                  prompt_peak)

COUNTED = ["keydiff:budget=48:block_size=16", "keydiff:compression_ratio=0.5", "streaming:budget=40",
           "streaming:compression_ratio=0.75", "knorm:budget=30", "knorm:compression_ratio=0.6",
           "keydiff:budget=20:block_size=1",
           # fed attention, which picks which entries stay, never how many (`counts_ignore_attention`)
           "snapkv:budget=40", "snapkv:compression_ratio=0.5", "tova:budget=40", "tova:compression_ratio=0.5",
           "h2o:budget=40", "h2o:heavy_budget=10:recent_budget=20", "h2o:compression_ratio=0.6"]


def forwards(prompt: int, total: int, chunk: int) -> list[tuple[int, int]]:
    """A request's forwards as vLLM schedules them: the prompt in chunks of `chunk`, then one token each."""
    out, start = [], 0
    while start < prompt:
        out.append((start, min(prompt, start + chunk)))
        start = out[-1][1]
    return out + [(n, n + 1) for n in range(prompt, total)]


@pytest.mark.parametrize("spec", COUNTED)
@pytest.mark.parametrize("prompt,total,chunk", [(100, 260, 1000), (100, 260, 32), (30, 120, 7), (8, 60, 8)])
def test_counting_by_schedule_is_the_stand_in(spec, prompt, total, chunk):
    method = parse_method_spec(spec).build()
    counted, stand_in = StoredCounts(method), StoredCounts(method)
    assert counted.by_count
    stand_in.by_count = False  # the general path: the method on stand-in keys
    for start, end in forwards(prompt, total, chunk):
        steps = forward_steps(start, end, prompt)
        assert counted.advance(steps) == stand_in.advance(steps), (start, end)
        assert counted.discarded == stand_in.discarded, (start, end)
    # a recomputed request: its prompt and generated tokens in one forward (prompt end, then an append)
    again, again_stand_in = StoredCounts(method), StoredCounts(method)
    again_stand_in.by_count = False
    steps = forward_steps(0, total - 10, prompt)
    assert again.advance(steps) == again_stand_in.advance(steps)
    assert again.discarded == again_stand_in.discarded


@pytest.mark.parametrize("spec", ["lagkv:lag_size=16:sink_size=4", "lagkv:keep_ratio=0.125:lag_size=8:sink_size=2",
                                  "lagkv:keep_ratio=0.75:lag_size=8", "lagkv:keep_ratio=0.5:lag_size=2:sink_size=0"])
@pytest.mark.parametrize("prompt,total,chunk", [(100, 260, 1000), (100, 260, 32), (30, 120, 7), (8, 60, 8)])
def test_counting_by_length_is_the_stand_in(spec, prompt, total, chunk):
    """LagKV's reference mode is counted by `stored_after`: the same due forwards and counts as the method run
    on stand-in keys (whose own cuts the method decides), forward by forward and for a recomputed request."""
    method = parse_method_spec(spec).build()
    counted, stand_in = StoredCounts(method), StoredCounts(method)
    assert counted.by_length and not counted.by_count
    stand_in.by_length = False
    for start, end in forwards(prompt, total, chunk):
        steps = forward_steps(start, end, prompt)
        assert counted.advance(steps) == stand_in.advance(steps), (start, end)
        assert counted.discarded == stand_in.discarded and counted.held == stand_in.held, (start, end)
    again, again_stand_in = StoredCounts(method), StoredCounts(method)
    again_stand_in.by_length = False
    steps = forward_steps(0, total - 10, prompt)
    assert again.advance(steps) == again_stand_in.advance(steps) and again.discarded == again_stand_in.discarded


@pytest.mark.parametrize("spec", ["lagkv:compression_ratio=0.5:lag_size=8", "lazyeviction:budget=40:window=8",
                                  "lagkv:lag_size=16:skip_layers=1", "lagkv:keep_ratio=1:lag_size=8"])
def test_methods_with_their_own_rules_run_on_stand_in_keys(spec):
    counts = StoredCounts(parse_method_spec(spec).build())
    assert not counts.by_count and not counts.by_length


def test_plan_forward_starts_a_request_afresh():
    method = parse_method_spec("streaming:budget=40").build()
    counts, due = plan_forward(None, method, 0, 100, 100)
    assert due is not None and due.end == 100 and due.discarded == 60 and due.steps[0].ends_prompt
    counts, due = plan_forward(counts, method, 100, 101, 100)
    assert due.discarded == 61  # every step over budget evicts
    again, due = plan_forward(counts, method, 0, 50, 100)
    assert due is None and again is None  # recomputed: a new first chunk, nothing due yet, its counts start over


def block_forwards(prompt: int, total: int, block: int, chunk: int) -> list[tuple[int, int]]:
    """A request's forwards when vLLM's chunks (`chunk` tokens) are cut at the method's block ends
    (`block_end`, as `TrimScheduler` cuts them): prompt, then one token each."""
    out, start = [], 0
    while start < prompt:
        out.append((start, min(start + chunk, block_end(start, prompt, block))))
        start = out[-1][1]
    return out + [(n, n + 1) for n in range(prompt, total)]


@pytest.mark.parametrize("chunk", [1000, 16, 5])
def test_prompt_blocks_are_told_whole_however_vllm_chunks_them(chunk):
    """A forward that ends inside a block tells nothing; the one that completes it tells the whole block (a
    prompt forward, ending the prompt on the last), so the steps are `kvtrim.prefill`'s blocks of 16."""
    told = []
    for start, end in block_forwards(70, 72, 16, chunk):
        told += forward_steps(start, end, 70, 16)
    assert told == [(Phase.PREFILL, False, 16)] * 4 + [(Phase.PREFILL, True, 6)] + [(Phase.DECODE, False, 1)] * 2
    with pytest.raises(KvtrimError, match="crosses the end of its prompt block at 32"):
        forward_steps(20, 40, 70, 16)


@pytest.mark.parametrize("spec", ["keydiff:budget=48:block_size=16", "keydiff:budget=20:block_size=7",
                                  "keydiff:budget=30:block_size=40"])
@pytest.mark.parametrize("chunk", [1000, 16, 5])
def test_block_counts_are_the_stand_in(spec, chunk):
    method = parse_method_spec(spec).build()
    block = prompt_block(method)
    counted, stand_in = StoredCounts(method), StoredCounts(method)
    stand_in.by_count = False
    for start, end in block_forwards(130, 260, block, chunk):
        steps = forward_steps(start, end, 130, block)
        assert counted.advance(steps) == stand_in.advance(steps), (start, end)
        assert counted.discarded == stand_in.discarded and counted.held == stand_in.held, (start, end)


def simulated_prompt_peak(spec: str, prompt: int) -> int:
    """`kvtrim.prefill`'s way on random keys: the prompt in blocks of the method's size, each a prompt forward
    (the last ending it); the most entries the layer held inside a forward (before its eviction)."""
    method = parse_method_spec(spec).build()
    cache, block = TrimCache(method), method.prefill_block_size()
    gen = torch.Generator().manual_seed(0)
    peak = 0
    for start in range(0, prompt, block):
        q = min(block, prompt - start)
        held = cache.layers[0].stored if cache.layers else 0
        peak = max(peak, held + q)
        k, v = torch.randn(2, 1, 2, q, 8, generator=gen)
        with cache.phase(Phase.PREFILL, ends_prompt=start + q == prompt):
            cache.update(k, v, 0)
    return peak


@pytest.mark.parametrize("spec", ["keydiff:budget=48:block_size=16", "keydiff:budget=50:block_size=16",
                                  "keydiff:budget=20:block_size=64"])
@pytest.mark.parametrize("prompt", [1, 30, 48, 64, 65, 200])
def test_prompt_peak_is_the_simulated_one(spec, prompt):
    assert prompt_peak(parse_method_spec(spec).build(), prompt) == simulated_prompt_peak(spec, prompt)


def test_a_prompt_in_one_block_peaks_at_its_length():
    assert prompt_peak(parse_method_spec("keydiff:compression_ratio=0.5").build(), 700) == 700


@pytest.mark.parametrize("spec", ["keydiff:budget=48:block_size=16", "keydiff:budget=50:block_size=7"])
def test_longest_peak_is_the_worst_split_of_the_tokens(spec):
    """What the server's KV-cache spec reports: the most any request of at most `max_len` tokens holds, by brute
    force over every prompt length (its prompt's blocks, then decoding to `max_len`)."""
    method = parse_method_spec(spec).build()
    worst = max(max(prompt_peak(method, p), method.peak_stored(p, 300)) for p in range(1, 300))
    assert longest_peak(method, 300) == worst < 300
    assert longest_peak(parse_method_spec("keydiff:compression_ratio=0.5").build(), 300) == 300
    assert longest_peak(None, 300) == 300


@pytest.mark.parametrize("spec", ["snapkv:compression_ratio=0.5:window=8", "snapkv:compression_ratio=0.75",
                                  "snapkv:compression_ratio=0.25:window=4:kernel=1"])
@pytest.mark.parametrize("prompt,total,chunk", [(100, 160, 1000), (100, 160, 32), (30, 80, 7), (3, 20, 8)])
def test_snapkv_counts_are_the_real_methods(spec, prompt, total, chunk):
    """SnapKV `compression_ratio=` runs on stand-in keys and queries (one KV head, head_dim 8): forward by forward,
    the same due forwards and counts as the method on keys and queries of a model's shape (3 KV heads, 9 query
    heads, head_dim 16) fed as transformers feeds it (the prompt in one forward that ends it, its queries handed
    over by kvtrim's attention, then one token a step), however vLLM chunks the prompt; a recomputed request
    (prompt and generated tokens in one forward) too."""
    method = parse_method_spec(spec).build()
    gen = torch.Generator().manual_seed(1)

    def real_forward(cache, phase, ends, n):
        k, v = torch.randn(2, 1, 3, n, 16, generator=gen)
        with cache.phase(phase, ends_prompt=ends):
            cache.update(k, v, 0)
        layer = cache.layers[0]
        layer.after_attention(torch.randn(1, 9, n, 16, generator=gen), None, None)
        return layer

    counts, cache = StoredCounts(method), TrimCache(method)
    assert counts.by_count  # its queries pick which entries, never how many: counted by its schedule
    evictions = 0
    for start, end in forwards(prompt, total, chunk):
        due = counts.advance(forward_steps(start, end, prompt))
        if end < prompt:  # the prompt is told once, complete
            assert not due
            continue
        prompt_end = start < prompt
        layer = real_forward(cache, Phase.PREFILL if prompt_end else Phase.DECODE, prompt_end,
                             prompt if prompt_end else end - start)
        assert due == (layer.evictions != evictions), (start, end)
        evictions = layer.evictions
        assert counts.held == layer.stored and counts.discarded == layer.seen - layer.stored, (start, end)
    n_keep = kept_count(prompt, method.compression_ratio)
    assert evictions == (n_keep < prompt) and counts.held == min(n_keep, prompt) + total - prompt
    again, cache = StoredCounts(method), TrimCache(method)
    due = again.advance(forward_steps(0, total - 10, prompt))
    real_forward(cache, Phase.PREFILL, True, prompt)
    layer = real_forward(cache, Phase.APPEND, False, total - 10 - prompt)
    assert due == (layer.evictions > 0) and again.held == layer.stored and again.discarded == layer.seen - layer.stored


@pytest.mark.parametrize("spec", ["snapkv:budget=40:window=8:block_size=16", "snapkv:budget=20:window=12:block_size=7",
                                  "snapkv:budget=40:window=8", "snapkv:budget=200"])
@pytest.mark.parametrize("prompt,total,chunk", [(100, 160, 1000), (100, 160, 5), (30, 80, 7), (3, 20, 8)])
def test_snapkv_budget_counts_are_the_real_methods(spec, prompt, total, chunk):
    """SnapKV `budget=` (with `block_size=`: its prompt in blocks) on stand-in keys and queries: forward by forward
    the same due forwards and counts as the method on a model's shapes fed as `kvtrim.prefill` feeds it (each
    block one prompt forward, its queries handed over by kvtrim's attention, then one token a step), however vLLM
    chunks the blocks; the prompt's peak is the simulated one."""
    method = parse_method_spec(spec).build()
    block = prompt_block(method)
    gen = torch.Generator().manual_seed(2)
    counts, cache, evictions, told, peak = StoredCounts(method), TrimCache(method), 0, 0, 0
    assert counts.by_count
    for start, end in (block_forwards(prompt, total, block, chunk) if block else forwards(prompt, total, chunk)):
        steps = forward_steps(start, end, prompt, block)
        due = counts.advance(steps)
        for step in steps:
            q = step.tokens
            if step.phase is Phase.PREFILL:
                peak = max(peak, (cache.layers[0].stored if cache.layers else 0) + q)
            k, v = torch.randn(2, 1, 3, q, 16, generator=gen)
            with cache.phase(step.phase, ends_prompt=step.ends_prompt):
                cache.update(k, v, 0)
            cache.layers[0].after_attention(torch.randn(1, 9, q, 16, generator=gen), None, None)
            told += q
        if not steps:
            assert not due
            continue
        layer = cache.layers[0]
        assert due == (layer.evictions != evictions), (start, end)
        evictions = layer.evictions
        assert counts.held == layer.stored and counts.discarded == layer.seen - layer.stored, (start, end)
    assert told == total and cache.layers[0].stored == min(prompt, method.budget) + total - prompt
    assert prompt_peak(method, prompt) == peak


@pytest.mark.parametrize("spec", ["tova:budget=40", "tova:compression_ratio=0.5", "tova:budget=200", "h2o:budget=40",
                                  "h2o:compression_ratio=0.5", "h2o:heavy_budget=5:recent_budget=10", "h2o:budget=200",
                                  "lazyeviction:budget=40:window=8", "lazyeviction:budget=30:window=7:gqa=per_query_head",
                                  "lazyeviction:budget=200:window=16"])
@pytest.mark.parametrize("prompt,total,chunk", [(100, 160, 1000), (100, 160, 32), (30, 80, 7), (3, 20, 8)])
def test_decode_attention_counts_are_the_real_methods(spec, prompt, total, chunk):
    """TOVA and H2O counted by their schedule, LazyEviction by its decode steps: forward by
    forward, the same due forwards and counts as the method on keys, queries and probabilities of a model's
    shape (3 KV heads, 9 query heads, head_dim 16) fed as transformers feeds it (the prompt in one forward,
    then one token a step with the probabilities kvtrim's attention hands over), however vLLM chunks the
    prompt; a recomputed request (prompt and generated tokens in one forward) too. H2O's state (accumulated
    attention) changes at every forward, LazyEviction's (its recurrence) at every decode step: each is then due."""
    method = parse_method_spec(spec).build()
    gen = torch.Generator().manual_seed(2)

    def real_forward(cache, phase, ends, n):
        k, v = torch.randn(2, 1, 3, n, 16, generator=gen)
        with cache.phase(phase, ends_prompt=ends):
            full, _ = cache.update(k, v, 0)
        layer = cache.layers[0]
        probs = torch.randn(1, 9, 1, full.shape[-2], generator=gen).softmax(-1) if phase is Phase.DECODE else None
        layer.after_attention(torch.randn(1, 9, n, 16, generator=gen), probs, None)
        return layer

    counts, cache = StoredCounts(method), TrimCache(method)
    lazy = spec.startswith("lazyeviction")  # counted by its decode steps (`kept_after_decode`); TOVA, H2O by their schedule
    assert (counts.by_decode if lazy else counts.by_count) and not counts.by_length  # its prompt and appends restart its tracking: no change there
    stateful = method.new_state(0) is not None
    evictions = 0
    for start, end in forwards(prompt, total, chunk):
        due = counts.advance(forward_steps(start, end, prompt))
        if end < prompt:
            assert not due
            continue
        prompt_end = start < prompt
        layer = real_forward(cache, Phase.PREFILL if prompt_end else Phase.DECODE, prompt_end,
                             prompt if prompt_end else end - start)
        # H2O's scores change at every forward: every one is due (the worker carries them between compactions)
        assert due == (layer.evictions != evictions or stateful and not (lazy and prompt_end)), (start, end)
        evictions = layer.evictions
        assert counts.held == layer.stored and counts.discarded == layer.seen - layer.stored, (start, end)
    again, cache = StoredCounts(method), TrimCache(method)
    due = again.advance(forward_steps(0, total - 10, prompt))
    real_forward(cache, Phase.PREFILL, True, prompt)
    layer = real_forward(cache, Phase.APPEND, False, total - 10 - prompt)
    assert due == (layer.evictions > 0 or stateful and not lazy) and again.held == layer.stored and again.discarded == layer.seen - layer.stored
