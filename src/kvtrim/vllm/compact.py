"""A request's compactions: what a `TrimCache` keeps, applied to the request's vLLM blocks.

At a forward the scheduler planned as due (`kvtrim.vllm.planning`), `compact` reads the stored keys and
values from the blocks (`kvtrim.vllm.block_io`), resumes a `TrimCache` with them in position order
(`TrimLayer.resume`), feeds it the forward's steps on the real new entries (`kvtrim.vllm.decide`), and moves
only the kept entries that lie past the kept count into the slots evicted entries left (`fill_holes`; a
StreamingLLM decode step moves nothing: the slot it evicts, the same in every layer and KV head, takes the
next token, `RequestEntries.fill_hole`): no method is implemented a second time. Stored order is then not
token order, which attention over stored entries does not see (RoPE is in the keys); the positions per slot
are kept beside them (`RequestEntries`, `kvtrim.vllm.entries`: the positions of the request's stored entries
per layer and the method's per-layer state, as of its last compaction).
"""

from __future__ import annotations

from typing import Any

import torch

from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import EvictionMethod, Phase, check
from kvtrim.vllm import layout as cpu_vec
from kvtrim.vllm.block_io import fill_holes, fill_layers_holes, move_layers_entries, move_slots, read_stored, store_moves
from kvtrim.vllm.block_layout import BlockLayout
from kvtrim.vllm.decide import decide
from kvtrim.vllm.entries import RequestEntries, per_tensor
from kvtrim.vllm.live import LiveInPlace, in_place_decode_step, live_decode_step, live_layer_kind
from kvtrim.vllm.live_batch import BatchRows
from kvtrim.vllm.planning import Step, leaves_hole


def compact(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, method: EvictionMethod,
            entries: RequestEntries, steps: list[Step], end: int, prompt_tokens: int,
            queries: list[torch.Tensor] | None = None, scales: list[float] | None = None,
            last: list[torch.Tensor] | None = None, sums: list[torch.Tensor] | None = None,
            layout: BlockLayout = cpu_vec, step_probs: torch.Tensor | None = None) -> int:
    """Run a due forward's `steps` (bringing the request's tokens up to `end`; its prompt has `prompt_tokens`)
    through `method` on the keys and values stored in every layer's cache `(num_blocks, kv_heads, block_size,
    2 * head_dim)`, move the kept entries into the first slots (only those past them move, into the slots
    of evicted ones: `fill_holes`) and update `entries`. Returns the entries discarded so far (every layer
    and KV head the same: vLLM's block table is shared).

    A method that reads positions only (`positions_only`: StreamingLLM) decides once, on no keys, for every
    layer whose slots hold the same positions (all of them, when it is the only method that compacted the
    request), and only the moved entries are read. When a decode step evicts one entry, from the same slot in
    every KV head (StreamingLLM over its budget), nothing moves: the slot is left as `entries.hole`, and the
    request's next token is written there (`RequestEntries.fill_hole`). A method whose layers are alike
    (`layers_alike`: KeyDiff, KNorm, LagKV, TOVA, H2O, LazyEviction) decides `_layer_group` layers at a time, as
    one batch (each layer a batch row; the group's method state is one object, shared by its layers in
    `entries.states`); any other decides layer by layer.

    A method that needs queries (SnapKV, TOVA, H2O) gets, with the forward that ends a prompt block (the whole
    prompt, unless it reads it in blocks: SnapKV `block_size=`), `queries` per layer `(q_heads, W, head_dim)`
    (the block's last `W` post-RoPE queries, what the worker's attention tap captured) and the layers' softmax `scales` (`decide`). A method that needs the attention of its decode
    steps (TOVA, H2O, LazyEviction) gets, with a forward after the prompt, `last` per layer `(q_heads, q,
    head_dim)`: the queries of its tokens after the prompt, from which `decide` computes a decode step's
    probabilities. Such a method's decode steps (`attention_only_decode`) run on the request's decision layer,
    kept from one step to the next in `entries.live` (`kvtrim.vllm.live`: `LiveInPlace` for a method that evicts in
    place, TOVA and H2O, in the blocks' slot order; `LiveDecode` for LazyEviction; its positions and the method's
    state live across steps; it is resumed from the positions only after any other compaction; a request whose steps
    the worker decided in a batch with others takes its rows back first, `BatchRows.detach`), with keys alone read, or
    none: `step_probs` `(layers, q_heads, 1, stored)`, slot order, when kvtrim's attention backend computed the
    step's probabilities already (`QueryTap.step_probs`; `last` is then its queries `(layers, q_heads, 1, head_dim)`). H2O gets, with the forward that ends the prompt, `sums` per layer `(kv_heads, prompt)` instead
    of queries: its prompt's attention column sums, which the worker adds up chunk by chunk.

    `layout`: how the caches store their blocks (`kvtrim.vllm.block_layout`; default vLLM's CPU kernel "vec")."""
    check(entries.hole is None, "the request's hole was not filled before its next compaction")
    if isinstance(entries.live, BatchRows):  # its decode steps were decided in a batch until now: its rows back
        entries.live.detach(entries, prompt_tokens)
    told = end - sum(step.tokens for step in steps)  # tokens the method was told before this forward
    stored = entries.m + end - entries.seen
    old = stored - (end - told)  # entries stored before this forward's tokens
    h, n_layers = kv_caches[0].shape[1], len(kv_caches)
    states = entries.states or [None] * n_layers
    forward = old, told, steps, prompt_tokens  # what `decide` needs of the forward besides the entries
    hole = live = None
    previous_live, entries.live = entries.live, None  # kept by a decode step that leaves a hole, or that reads attention
    decode_step = (method.attention_only_decode and last is not None and scales is not None and len(set(scales)) == 1
                   and len(steps) == 1 and steps[0].phase is Phase.DECODE and _groups_share_states(states, n_layers))
    live_kind = live_layer_kind(method)
    follows = decode_step and isinstance(previous_live, live_kind) and previous_live.follows(told, old, states[0])
    if isinstance(previous_live, LiveInPlace) and not follows:  # its state is in slot order: back to position order
        states = [previous_live.settled_state()] * n_layers
    slot_positions = None  # (the live layer of an attention-fed decode step holds them)
    if not follows:
        slot_positions = _extended(entries.positions, torch.arange(entries.seen, end).expand(h, -1), n_layers)
    if slot_positions is not None and not method.waits_for_attention and method.positions_only and all(
            p is slot_positions[0] or torch.equal(p, slot_positions[0]) for p in slot_positions[1:]):
        n_keep, positions, state, hole, live = _compact_positions_only(method, kv_caches, block_ids, slot_positions[0],
                                                                       states[0], forward, previous_live, layout)
        # one positions tensor for every layer: the next compaction finds them shared at once
        new_positions, new_states, kept_counts = [positions] * n_layers, [state] * n_layers, {n_keep}
    elif decode_step:
        # a decode step of a method that reads only its probabilities there: the request's decision layer, kept
        # from its last decode step (or resumed from its positions), takes the step; keys alone are read
        if slot_positions is not None:
            previous_live = live_kind.resumed(method, torch.stack(slot_positions)[:, :, :old], states[0], told,
                                              prompt_tokens)
        if live_kind is LiveInPlace:  # in the blocks' slot order: the evicted entry's slot takes the step's token
            n_keep, live, positions, state = in_place_decode_step(kv_caches, block_ids, previous_live, last, scales[0],
                                                                   layout, step_probs)
        else:
            n_keep, live = live_decode_step(kv_caches, block_ids, previous_live, last, scales[0], layout, step_probs)
            positions, state = live.slot_positions, live.layer.state
        new_positions, new_states, kept_counts = list(positions.unbind(0)), [state] * n_layers, {n_keep}
    elif method.layers_alike() and _groups_share_states(states, size := _layer_group(method, n_layers)) and (
            scales is None or len(set(scales)) == 1):
        new_positions, new_states, kept_counts = [], [], set()
        for first in range(0, n_layers, size):  # groups of layers: small temporaries, reused memory
            group = slice(first, first + size)
            n_keep, positions, state = _compact_as_one_batch(
                method, kv_caches[group], block_ids, slot_positions[group], states[first], forward,
                None if queries is None else queries[group], None if scales is None else scales[first],
                None if last is None else last[group], None if sums is None else sums[group], layout)
            new_positions += positions
            new_states += [state] * len(positions)  # the group's state (batch row i: its layer i), shared
            kept_counts.add(n_keep)
    else:
        new_positions, new_states, kept_counts = [], [], set()
        cache = TrimCache(method, in_place_decode=False)
        for idx, kv in enumerate(kv_caches):
            keys, values = read_stored(layout, method, kv, block_ids, slot_positions[idx].shape[-1])
            layer, kept, n_keep = decide(cache, idx, keys[None], None if values is None else values[None],
                                         slot_positions[idx][None], *forward,
                                         states[idx], None if queries is None else queries[idx][None],
                                         None if scales is None else scales[idx],
                                         None if last is None else last[idx][None],
                                         sums=None if sums is None else sums[idx][None])
            heads, from_slots, to_slots, order = fill_holes(kept[0], n_keep)
            if heads.numel():
                store_moves(layout, kv, block_ids, heads, from_slots, to_slots, keys, values)
            new_positions.append(slot_positions[idx].gather(-1, order))
            kept_counts.add(n_keep)
            new_states.append(layer.state)
    check(len(kept_counts) == 1,
          f"{type(method).__name__} kept different numbers of entries per layer ({sorted(kept_counts)})")
    entries.positions, entries.seen, entries.states, entries.hole = new_positions, end, new_states, hole
    entries.live = live
    return end - kept_counts.pop()


def _compact_positions_only(method: EvictionMethod, kv_caches, block_ids, slot_positions: torch.Tensor, state: Any,
                            forward: tuple, live: TrimCache | None = None, layout: BlockLayout = cpu_vec):
    """`compact` for a positions-only method whose layers hold the same positions `(h, stored)`: one decision on
    stand-in keys, the same moves in every layer (or a hole: `compact`). A decode step of a method that decides
    in place (`in_place_decode`: StreamingLLM `budget=`) runs in place on the request's `live` layer, or on one
    resumed in slot order (`_live_layer`): no sort, no search, and a step that evicts one entry from the same
    slot of every KV head leaves that slot free in the layer as the engine leaves it as a hole (any other
    outcome is decided again the general way). Returns the kept
    count, the new positions `(h, slots)`, the method's state, the hole (or None) and the live layer to keep."""
    stored = slot_positions.shape[-1]
    live = _live_layer(method, live, slot_positions, state, forward)
    if live is not None:
        layer = live.layers[0]
        with live.phase(Phase.DECODE):
            live.update(*torch.zeros(2, 1, slot_positions.shape[0], 1, 1), 0)  # the step's token, where the engine wrote it
        free = getattr(layer.kv, "free_slots", None)
        if free is not None and bool((free == free[0, 0]).all()):  # one entry left, the same slot in every head
            return stored - 1, layer.kv.positions[0], layer.state, int(free[0, 0]), live
        # anything else: decided again below, the general way (the live layer held stand-ins, and no state)
    layer, kept, n_keep = decide(TrimCache(method, in_place_decode=False), 0, None, None, slot_positions[None],
                                 *forward, state)
    kept = kept[0]
    lost = (~kept).nonzero()  # (evicted, 2): (head, slot), head-major
    if leaves_hole(forward[2]) and n_keep == stored - 1 and bool((lost[:, 1] == lost[0, 1]).all()):
        # one entry left, from the same slot in every KV head (and layer): nothing moves, the next token is
        # written there (the worker's `fill_hole`)
        return n_keep, slot_positions, layer.state, int(lost[0, 1]), None
    heads, from_slots, to_slots, order = fill_holes(kept, n_keep)
    if heads.numel():
        n_layers = len(kv_caches)  # the same moves in every layer
        move_slots(layout, kv_caches, block_ids, torch.arange(n_layers).repeat_interleave(heads.numel()),
                   heads.repeat(n_layers), from_slots.repeat(n_layers), to_slots.repeat(n_layers))
    return n_keep, slot_positions.gather(-1, order), layer.state, None, None


def _live_layer(method: EvictionMethod, live: TrimCache | None, slot_positions: torch.Tensor, state: Any,
                forward: tuple) -> TrimCache | None:
    """The one-layer cache a positions-only method's single decode step runs on in place
    (`_compact_positions_only`), or None for any other step or method: `live`, when its layer is where the
    engine is (it has seen the tokens before the step and its free slot is where the engine wrote the step's
    token), else one resumed from the request's positions `(h, stored)` in slot order on stand-in keys (the
    slot the step's token took free)."""
    _, told, steps, prompt_tokens = forward
    if not (method.in_place_decode and state is None and steps == [Step(Phase.DECODE, False, 1)]):
        return None  # (a stateless method: a step the live layer cannot take is decided again from the positions)
    h, stored = slot_positions.shape
    if live is not None:
        layer = live.layers[0]
        free = getattr(layer.kv, "free_slots", None)
        if (layer.seen == told and free is not None and layer.kv.positions.shape[-1] == stored
                and bool((slot_positions[:, int(free[0, 0])] == told).all())):
            return live
    at = int((slot_positions[0] == told).nonzero()[0, 0])  # the step's token's slot (the same in every head)
    n = stored if at < stored - 1 else stored - 1  # a hole it filled stays in the layer, free; else it comes last
    cache = TrimCache(method)
    layer = TrimLayer(method, 0, owner=cache)
    cache.layers.append(layer)
    keys = torch.zeros(1, h, n, 1)
    layer.resume(keys, torch.zeros_like(keys), slot_positions[None, :, :n].clone(), told, prompt_tokens, state,
                 at if n == stored else None)
    return cache


#: layers a `layers_alike` method decides as one batch (`compact`): one run of the method per group instead of
#: per layer, while the group's temporaries stay small enough for the allocator to reuse their memory (one
#: batch of all 30 layers of SmolLM2 at 640 entries took longer than one run per layer: page faults)
LAYER_GROUP = 10


def _compact_as_one_batch(method: EvictionMethod, kv_caches, block_ids, slot_positions: list[torch.Tensor], state: Any,
                          forward: tuple, queries: list[torch.Tensor] | None = None, scale: float | None = None,
                          last: list[torch.Tensor] | None = None, sums: list[torch.Tensor] | None = None,
                          layout: BlockLayout = cpu_vec):
    """`compact` for a `layers_alike` method on some of a request's layers: their stored entries read, then decided
    as one batch (one run of the method instead of one per layer; a method fed attention gets each layer's
    `queries` and `last` as its batch row, with the layers' one softmax `scale`), then each layer's moves
    written. `state`: the group's, as the last batch left it (None at first). Returns the kept count, the new
    positions per layer `(h, slots)` and the method's state for the group."""
    stored = slot_positions[0].shape[-1]
    reads = [read_stored(layout, method, kv, block_ids, stored) for kv in kv_caches]
    keys = torch.stack([k for k, _ in reads])
    values = None if reads[0][1] is None else torch.stack([v for _, v in reads])
    positions = torch.stack(slot_positions)  # (layers, h, stored)
    cache = TrimCache(method, in_place_decode=False)  # one per batch: a cache's layers share its batch size
    layer, kept, n_keep = decide(cache, 0, keys, values, positions, *forward, state,
                                 None if queries is None else torch.stack(queries), scale,
                                 None if last is None else torch.stack(last),
                                 sums=None if sums is None else torch.stack(sums))
    if values is None:  # nothing read but keys: copied inside the pool
        order = move_layers_entries(layout, kv_caches, block_ids, kept, n_keep)
    else:
        moves, order = fill_layers_holes(kept, n_keep)
        for idx, heads, from_slots, to_slots in moves:
            store_moves(layout, kv_caches[idx], block_ids, heads, from_slots, to_slots, keys[idx], values[idx])
    return n_keep, list(positions.gather(-1, order).unbind(0)), layer.state



def _layer_group(method: EvictionMethod, n_layers: int) -> int:
    """How many layers a `layers_alike` method decides as one batch: `LAYER_GROUP`, or every layer for a method
    that reads only its probabilities while decoding (`attention_only_decode`: its decode steps, every step, read
    keys only, whose temporaries stay small; one run per step instead of one per group)."""
    return n_layers if method.attention_only_decode else LAYER_GROUP


def _groups_share_states(states: list[Any], size: int) -> bool:
    """True when the layers of each group of `size` share one state object (or have none): what a batched
    compaction leaves (`_compact_as_one_batch`), so the next one can run the group as one batch again."""
    return all(s is states[first] for first in range(0, len(states), size) for s in states[first:first + size])



def _extended(positions: list[torch.Tensor] | None, new: torch.Tensor, n_layers: int) -> list[torch.Tensor]:
    """Each layer's slot positions `(h, m)` followed by the `new` tokens' `(h, q)` (`per_tensor`)."""
    if positions is None:
        return [new] * n_layers
    return per_tensor(positions, lambda p: torch.cat([p, new], dim=-1))

