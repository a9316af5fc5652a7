"""In-place decoding (the freed slot takes the next entry) against the copying path: same kept sets, same
tokens, no reallocation; the position-order rules of each method against today's selections."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import kvtrim
from kvtrim.methods.base import EvictOne, LayerView, Phase, keep_top, lowest_slot
from kvtrim.methods.h2o import h2o_keep
from kvtrim.methods.streaming import streaming_keep
from kvtrim.storage import DenseKV, SlotKV

METHODS = {
    "h2o-budget": lambda: kvtrim.H2O(budget=24),
    "h2o-heavy-recent": lambda: kvtrim.H2O(heavy_budget=7, recent_budget=13),
    "h2o-ratio": lambda: kvtrim.H2O(compression_ratio=0.6),
    "tova": lambda: kvtrim.TOVA(budget=21),
    "tova-ratio": lambda: kvtrim.TOVA(compression_ratio=0.5),
    "streaming": lambda: kvtrim.StreamingLLM(budget=25, sink_size=4),
}


def decode_run(model, method, ids, steps, in_place, each_step=None, shift=None):
    """Prompt `ids` in one forward (the prompt ends at the first decode step; TOVA with a ratio, which needs
    the prompt's last query then, through `kvtrim.prefill`), then `steps` greedy steps. `shift`: pass
    explicit position ids, each token's index plus `shift` (0: the default positions, given explicitly).
    Returns (tokens (batch, steps), per step the sorted kept positions of every layer, the cache)."""
    cache = kvtrim.TrimCache(method, config=model.config, in_place_decode=in_place)
    kept, tokens = [], []
    n = ids.shape[-1]

    def positions(start, count):
        return {} if shift is None else {"position_ids": torch.arange(start, start + count)[None] + shift}

    with torch.no_grad():
        if isinstance(method, kvtrim.TOVA) and method.budget is None:
            logits = kvtrim.prefill(model, ids, cache)
        else:
            logits = model(ids, cache=cache, **positions(0, n)).logits[:, -1]
        for step in range(steps):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(token)
            logits = model(token, cache=cache, **positions(n + step, 1)).logits[:, -1]
            kept.append([layer.kept_positions().tolist() for layer in cache.layers])
            if each_step is not None:
                each_step(step, cache)
    return torch.cat(tokens, dim=-1), kept, cache


def live_order(layer) -> torch.Tensor:
    """`(b, h, stored)`: the slots of the live entries of an in-place layer, in position order."""
    positions = layer.positions
    if layer.free_slots is not None:
        positions = positions.scatter(-1, layer.free_slots[..., None], 10**9)
    return positions.argsort(-1)[..., : layer.stored]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_in_place_keeps_the_same_entries_and_tokens_as_copying(name):
    model = kvtrim.enable(tiny_model("llama", layers=2))
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(11))
    ref_tokens, ref_kept, ref_cache = decode_run(model, METHODS[name](), ids, 300, in_place=False)
    tensors = {}

    def same_tensor(step, cache):  # from the third step on, no layer's key tensor is reallocated
        for i, layer in enumerate(cache.layers):
            if step == 2:
                tensors[i] = (layer.keys, layer.keys.data_ptr(), layer.values)
            elif step > 2:
                keys, ptr, values = tensors[i]
                assert layer.keys is keys and layer.keys.data_ptr() == ptr and layer.values is values, step

    tokens, kept, cache = decode_run(model, METHODS[name](), ids, 300, in_place=True, each_step=same_tensor)
    assert torch.equal(tokens, ref_tokens)
    for step, (got, want) in enumerate(zip(kept, ref_kept)):
        assert got == want, f"step {step}"
    ref_stats, stats = ref_cache.stats(), cache.stats()
    assert stats.stored_per_layer == ref_stats.stored_per_layer
    assert stats.bytes_stored == ref_stats.bytes_stored and stats.lengths_per_layer == ref_stats.lengths_per_layer
    for layer, ref in zip(cache.layers, ref_cache.layers):
        assert ref.free_slots is None and not isinstance(ref.kv, SlotKV)  # the copying path never runs in place
        assert isinstance(layer.kv, SlotKV)  # the in-place path left its layers in slot order
        assert layer.evictions == ref.evictions
        if name.startswith("h2o"):  # the accumulated scores follow the slots (up to summation order)
            torch.testing.assert_close(layer.state.scores.gather(-1, live_order(layer)), ref.state.scores,
                                       rtol=1e-5, atol=1e-6)
        layer.settle()  # back in position order: the same entries (their bits may differ in the last
        assert type(layer.kv) is DenseKV
        assert torch.equal(layer.positions, ref.positions)  # places: attention sums in slot order)
        assert layer.free_slots is None and layer.keys.shape == ref.keys.shape
        torch.testing.assert_close(layer.keys, ref.keys)
        torch.testing.assert_close(layer.values, ref.values)


@pytest.mark.parametrize("name", ["h2o-budget", "tova", "streaming"])
def test_appends_copies_and_batch_selection_after_in_place_steps_match_copying(name):
    """Forwards that do not run in place (an append), `copy` and batch selection put the layer back in
    position order first; the continuation equals the copying path's."""
    model = kvtrim.enable(tiny_model("qwen2", q_heads=6, kv_heads=2))
    ids = torch.randint(0, 256, (3, 36), generator=torch.Generator().manual_seed(5))
    question = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(6))
    runs = []
    for in_place in (False, True):
        cache = kvtrim.TrimCache(METHODS[name](), config=model.config, in_place_decode=in_place)
        kept = []
        with torch.no_grad():
            logits = model(ids, cache=cache).logits[:, -1]
            for step in range(60):
                if step == 20:
                    twin = cache.copy()  # an independent copy, mid-decoding
                    logits = model(question, cache=cache).logits[:, -1]  # an append: out of place
                if step == 40:
                    cache.batch_select_indices(torch.tensor([2, 0]))
                    logits = logits[[2, 0]]
                logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
                kept.append([layer.kept_positions().tolist() for layer in cache.layers])
            twin_logits = model(torch.zeros(3, 1, dtype=torch.long), cache=twin).logits
        runs.append((kept, twin_logits, [layer.kept_positions() for layer in twin.layers]))
    (ref_kept, ref_twin, ref_twin_kept), (kept, twin_logits, twin_kept) = runs
    assert kept == ref_kept
    for got, want in zip(twin_kept, ref_twin_kept):
        assert torch.equal(got, want)
    torch.testing.assert_close(twin_logits, ref_twin, rtol=1e-5, atol=1e-5)


def test_h2o_reads_its_recent_window_off_counted_positions_and_falls_back_to_ranks_otherwise():
    """With the default positions H2O finds its window from `seen` (no kthvalue); with custom position ids
    (shifted by 1000 at every step: not the token index) the layer says so and H2O ranks the positions. Both
    keep what the copying path keeps at every step."""
    model = kvtrim.enable(tiny_model("llama", layers=2))
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(8))
    for shift in (0, 1000):
        runs = []
        for in_place in (False, True):
            method = kvtrim.H2O(heavy_budget=5, recent_budget=9)
            _, kept, cache = decode_run(model, method, ids, 40, in_place=in_place, shift=shift)
            runs.append(kept)
            assert all(layer.counted_positions == (shift == 0) for layer in cache.layers)
        assert runs[0] == runs[1], shift


@pytest.mark.parametrize("last", [1, 4, 11])
def test_lowest_slot_with_the_window_start_given_drops_what_the_ranked_window_drops(last):
    """`last_from` (the window's first position, known to the caller) against the kthvalue rule, for a row
    whose newest `last` positions are the counted `seen - last` .. `seen - 1`, in any slot order."""
    n, seen = 12, 40
    gen = torch.Generator().manual_seed(last)
    for seed in range(30):
        old = torch.randperm(seen - last, generator=gen)[: n - last].sort().values
        positions = torch.cat([old, torch.arange(seen - last, seen)]).expand(2, 3, n)
        perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(6)]).view(2, 3, n)
        scores = torch.randint(0, 3, (2, 3, n), generator=gen).float()  # many ties
        s_pos, s_scores = positions.gather(-1, perm), scores.gather(-1, perm)
        assert torch.equal(lowest_slot(s_scores, s_pos, last=last, last_from=seen - last),
                           lowest_slot(s_scores, s_pos, last=last)), seed


def test_a_cache_prefilled_under_inference_mode_decodes_outside_it_by_copying():
    model = kvtrim.enable(tiny_model("llama"))
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = kvtrim.TrimCache(kvtrim.H2O(budget=16), config=model.config)
    with torch.inference_mode():
        logits = model(ids, cache=cache).logits[:, -1]
        for _ in range(3):  # in place inside inference mode
            logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
    assert all(layer.free_slots is not None for layer in cache.layers)
    with torch.no_grad():  # outside it, inference tensors cannot be written: settled and copied once
        logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
        assert all(layer.free_slots is None and torch.equal(layer.positions, layer.kept_positions())
                   for layer in cache.layers)
        for _ in range(3):  # then in place again, in tensors of its own
            logits = model(logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
    for layer in cache.layers:
        assert layer.free_slots is not None and layer.stored == 16 and not layer.keys.is_inference()


def test_the_off_switch_and_methods_without_the_flag_never_run_in_place():
    model = kvtrim.enable(tiny_model("llama"))
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    for method, flag in [(kvtrim.H2O(budget=16), False), (kvtrim.KeyDiff(budget=16, block_size=4), True)]:
        seen = []
        decode_run(model, method, ids, 12, in_place=flag,
                   each_step=lambda step, cache: seen.extend(layer.free_slots for layer in cache.layers))
        assert all(s is None for s in seen)
    with pytest.raises(kvtrim.KvtrimError, match="in_place_decode"):
        kvtrim.TrimCache(kvtrim.H2O(budget=4), in_place_decode=1)


# ---- the position-order rules, exactly (pure functions) --------------------------------------------
def shuffled(n: int, rows: tuple[int, int], seed: int, ties: bool):
    """Scores `(b, h, n)` (integers when `ties`: many equal) in position order, a slot order per row
    (a permutation), and the same scores and positions in slot order."""
    gen = torch.Generator().manual_seed(seed)
    b, h = rows
    scores = torch.randint(0, 4, (b, h, n), generator=gen).float() if ties else torch.rand(b, h, n, generator=gen)
    positions = torch.sort(torch.randperm(5 * n, generator=gen)[:n]).values.expand(b, h, n).contiguous()
    perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(b * h)]).view(b, h, n)
    return scores, positions, perm, scores.gather(-1, perm), positions.gather(-1, perm)


def dropped(keep: torch.Tensor, n: int) -> torch.Tensor:
    """`(b, h)`: the one index of `range(n)` missing from `keep` `(b, h, n - 1)`."""
    return n * (n - 1) // 2 - keep.sum(-1)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("first,last", [(0, 0), (2, 0), (0, 3), (2, 5), (7, 7)])
def test_lowest_slot_drops_what_keep_top_drops_in_any_storage_order(ties, first, last):
    for seed in range(30):
        scores, positions, perm, s_scores, s_positions = shuffled(12, (2, 3), seed, ties)
        want = dropped(keep_top(scores, 11, first, last), 12)  # an index in position order
        slot = lowest_slot(s_scores, s_positions, first, last)
        assert torch.equal(perm.gather(-1, slot[..., None])[..., 0], want), seed


def view_of(scores, positions, in_place):
    b, h, n = positions.shape
    keys = torch.zeros(b, h, n, 4)
    state = type("S", (), {"scores": scores})()
    return LayerView(keys=keys, values=keys, positions=positions, layer_idx=0, seen=int(positions.max()) + 1,
                     n_new=1, phase=Phase.DECODE, prompt_end=False, prompt_tokens=n, state=state,
                     in_place=in_place)


@pytest.mark.parametrize("ties", [False, True])
def test_each_method_evicts_in_slot_order_what_it_keeps_in_position_order(ties):
    n = 12
    methods = [kvtrim.H2O(budget=n - 1), kvtrim.H2O(heavy_budget=4, recent_budget=n - 5),
               kvtrim.H2O(heavy_budget=0, recent_budget=n - 1), kvtrim.StreamingLLM(budget=n - 1, sink_size=3),
               kvtrim.TOVA(budget=n - 1)]
    for seed in range(20):
        scores, positions, perm, s_scores, s_positions = shuffled(n, (2, 2), seed, ties)
        for method in methods:
            if isinstance(method, kvtrim.H2O):
                want = dropped(h2o_keep(scores, *method.budgets(n)), n)
            elif isinstance(method, kvtrim.StreamingLLM):
                want = dropped(streaming_keep(n, 3, n - 1, scores), n)
            else:
                want = dropped(keep_top(scores, n - 1), n)
            score = method.score  # TOVA / H2O read their scores elsewhere: hand them over directly
            method.score = lambda view, s=s_scores, m=method: view.positions if isinstance(
                m, kvtrim.StreamingLLM) else s
            try:
                got = method.evict_if_due(view_of(s_scores, s_positions, in_place=True))
            finally:
                method.score = score
            assert isinstance(got, EvictOne)
            assert torch.equal(perm.gather(-1, got.slots[..., None])[..., 0], want), (method, seed)


def test_several_leaving_in_place_are_kept_in_position_order():
    n = 15  # three over a budget of 12: `select` runs on the scores in position order
    method = kvtrim.TOVA(budget=12)
    for seed in range(10):
        scores, positions, perm, s_scores, s_positions = shuffled(n, (1, 2), seed, ties=True)
        want = keep_top(scores, 12)  # indices in position order
        method.score = lambda view, s=s_scores: s
        got = method.evict_if_due(view_of(s_scores, s_positions, in_place=True))
        assert torch.equal(s_positions.gather(-1, got), positions.gather(-1, want))
