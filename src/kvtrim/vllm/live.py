"""A request's decision layer between the decode steps of a method that reads only its probabilities there
(`attention_only_decode`: TOVA, H2O, LazyEviction), kept from one step to the next so that nothing is resumed per
step (`kvtrim.vllm.compact` hands each such step to it):

* `LiveInPlace` (methods that evict in place, `in_place_decode`: TOVA, H2O): the layer holds the request's entries
  in the blocks' own slot order, as transformers' in-place decoding does; the step's probabilities (slot order, from
  kvtrim's attention backend) go to the method as they come; the entry the method evicts leaves its slot,
  which the step's token (in the last slot) then fills, in the blocks and in the layer alike (`move_slots`,
  `TrimLayer.fill_free_slots_from_last`): one entry moved per layer and KV head, nothing sorted.
* `LiveDecode` (any other: LazyEviction, which evicts many entries every `window` steps): the layer in position
  order; each eviction also puts the blocks' kept entries in position order (`move_layers_into`), so that between
  evictions, the new entries appended last, slot order is position order and the step's probabilities go to the
  method as they come (before the first eviction of a request whose slots were in another order, they are
  gathered into position order, `by_position`).

The worker decides the steps of several requests of one method as one batch of either kind
(`kvtrim.vllm.live_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvtrim.attention import softmax_probabilities
from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import EvictionMethod, Phase, check
from kvtrim.vllm import layout as cpu_vec
from kvtrim.vllm.block_io import move_layers_entries, move_layers_into, move_slots
from kvtrim.vllm.block_layout import BlockLayout
from kvtrim.vllm.decide import hand_over, kept_slots


@dataclass
class LiveDecode:
    """A request's decision layer between the decode steps of a method that reads only its probabilities there
    (`attention_only_decode`: TOVA, H2O, LazyEviction): one `TrimLayer` whose batch rows are the request's layers,
    on stand-in keys in position order, with the method's state; it takes each decode step as transformers feeds
    it one (`live_decode_step`), so nothing is resumed per step. `slot_positions` `(layers, h, stored)`: the
    positions held in the request's slots after its last step; `by_position`: its `argsort(dim=-1)`, None when the
    slots are in position order (always after an eviction: module docstring)."""

    cache: TrimCache
    slot_positions: torch.Tensor
    by_position: torch.Tensor | None

    @property
    def layer(self) -> TrimLayer:
        return self.cache.layers[0]

    def follows(self, told: int, stored: int, state: Any) -> bool:
        """True when the layer is where the request is: it has seen the `told` tokens before the step, holds the
        `stored` entries and the method's `state` (nothing else compacted the request since)."""
        layer = self.layer
        return layer.seen == told and self.slot_positions.shape[-1] == stored and layer.state is state

    @classmethod
    def resumed(cls, method: EvictionMethod, slot_positions: torch.Tensor, state: Any, told: int,
                prompt_tokens: int) -> LiveDecode:
        """The layer resumed from the request's slot positions `(layers, h, stored)` and state after `told` tokens."""
        in_order = bool((slot_positions[..., 1:] > slot_positions[..., :-1]).all())
        by_position = None if in_order else slot_positions.argsort(dim=-1)
        cache = TrimCache(method, in_place_decode=False)
        layer = TrimLayer(method, 0, owner=cache, in_place_decode=False)
        cache.layers.append(layer)
        stand_in = torch.zeros(1, 1, 1, 1).expand(*slot_positions.shape, 1)
        layer.resume(stand_in, stand_in, slot_positions if in_order else slot_positions.gather(-1, by_position), told,
                     prompt_tokens if told >= prompt_tokens else None, layer.state if state is None else state)
        return cls(cache, slot_positions, by_position)

    #: the layer on rows of slot positions (`LiveInPlace.on_slots`; here without a free slot): as resumed
    on_slots = resumed

    @property
    def slots(self) -> torch.Tensor:
        """`(rows, h, stored)`: the positions in the rows' slots (`LiveInPlace.slots`)."""
        return self.slot_positions


def live_layer_kind(method: EvictionMethod) -> type:
    """The decision layer a method's decode steps run on: `LiveInPlace` when it evicts in place, else `LiveDecode`."""
    return LiveInPlace if method.in_place_decode else LiveDecode


def step_probabilities(kv_caches, block_ids, stored: int, query: torch.Tensor, scale: float, layout: BlockLayout,
                       probs: torch.Tensor | None) -> torch.Tensor:
    """A decode step's probabilities `(layers, q_heads, 1, stored)` in slot order: `probs` when kvtrim's attention
    backend computed them already (`QueryTap.step_probs`), else `softmax_probabilities` of the logits of the query
    `(layers, q_heads, 1, head_dim)` over the request's keys (`request_key_logits`, only keys read)."""
    if probs is None:
        probs = softmax_probabilities(layout.request_key_logits(kv_caches, block_ids, stored, query), None, scale)
    check(probs.shape[-1] == stored, f"the step's probabilities cover {probs.shape[-1]} entries, the request stores {stored}")
    return probs


def live_decode_step(kv_caches, block_ids, live: LiveDecode, last: list[torch.Tensor], scale: float,
                      layout: BlockLayout = cpu_vec, probs: torch.Tensor | None = None) -> tuple[int, LiveDecode]:
    """One decode step of a request on its `live` layer, every layer as one batch: the probabilities of each
    layer's query `last` `(q_heads, 1, head_dim)` (`step_probabilities`: only keys read, or none) go to the method
    (`decided_decode_step`); only the entries that move are copied, in the pool (`move_layers_into`). Returns the
    kept count and the live layer after the step."""
    query = (last if isinstance(last, torch.Tensor) else torch.stack(last)).to(kv_caches[0].dtype)  # (layers, q_heads, 1, d)
    probs = step_probabilities(kv_caches, block_ids, live.slot_positions.shape[-1] + 1, query, scale, layout, probs)
    return decided_decode_step(live, probs, query, scale,
                               lambda order: move_layers_into(layout, kv_caches, block_ids, order))


def decided_decode_step(live: LiveDecode, probs: torch.Tensor, query: torch.Tensor, scale: float,
                        move: Callable[[torch.Tensor], None]) -> tuple[int, LiveDecode]:
    """The method's decode step on `live`'s rows `(rows, h, stored)`: the step's `probs` `(rows, q_heads, 1, stored +
    1)` in slot order (the step's token in the last slot) and `query` `(rows, q_heads, 1, head_dim)`; the method gets
    them in position order (`hand_over`). When it evicts, `move(order)` puts the kept entries of every row in the
    pool in position order: slot `j` takes the entry at slot `order[..., j]` (`order` `(rows, h, n_keep)`,
    `move_layers_into`). Returns the kept count and the live layer after."""
    rows, h, old = live.slot_positions.shape
    told = live.layer.seen
    slot_positions = torch.cat([live.slot_positions, torch.full((rows, h, 1), told)], dim=-1)
    by_position = live.by_position
    if by_position is None:  # the slots in position order, the step's token last: the probabilities as they come
        in_order = probs
    else:  # each query head reads its KV head's entries: in position order, that head's own order
        by_position = torch.cat([by_position, torch.full((rows, h, 1), old)], dim=-1)  # the newest, last
        group = probs.shape[1] // h
        in_order = probs[:, :, 0].unflatten(1, (h, group)).gather(-1, by_position[:, :, None].expand(-1, -1, group, -1))
        in_order = in_order.view(rows, h * group, 1, old + 1)
    stand_in = torch.zeros(1, 1, 1, 1).expand(rows, h, 1, 1)
    with live.cache.phase(Phase.DECODE):
        full = live.cache.update(stand_in, stand_in, 0)
    hand_over(live.layer, Phase.DECODE, 1, full, None, query, scale, in_order)
    if live.layer.stored == old + 1:  # nothing evicted (LazyEviction between its evictions, H2O within budget)
        return old + 1, LiveDecode(live.cache, slot_positions, by_position)
    kept, n_keep = kept_slots(live.layer, slot_positions)
    # the kept entries' old slots in position order (ascending slots when those are in position order)
    order = (kept.nonzero()[:, -1] if by_position is None
             else by_position.masked_select(kept.gather(-1, by_position))).view(rows, h, n_keep)
    move(order)  # nothing read: copied inside the pool
    return n_keep, LiveDecode(live.cache, slot_positions.gather(-1, order), None)


@dataclass
class LiveInPlace:
    """A request's decision layer for a method that evicts in place (`in_place_decode`: TOVA, H2O), in the slot order
    of its blocks (module docstring): one `TrimLayer` whose batch rows are the request's layers, on stand-in keys,
    with the method's state in that order too; after each step its last slot is free (it takes the next step's
    token, as the engine writes it there) unless the step evicted nothing."""

    cache: TrimCache

    @property
    def layer(self) -> TrimLayer:
        return self.cache.layers[0]

    @property
    def slot_positions(self) -> torch.Tensor:
        """`(layers, h, stored)`: the positions in the request's slots."""
        kv = self.layer.kv
        return kv.positions[..., :kv.width]

    @property
    def slots(self) -> torch.Tensor:
        """`(rows, h, stored + 1)`: the positions in the rows' slots, the free last one included (what `on_slots`
        takes)."""
        return self.layer.kv.positions

    def follows(self, told: int, stored: int, state: Any) -> bool:
        """True when the layer is where the request is (`LiveDecode.follows`)."""
        layer = self.layer
        return layer.seen == told and layer.kv.width == stored and layer.state is state

    def settled_state(self) -> Any:
        """The method's state in position order, without the free slot: what any other compaction resumes from
        (`RequestEntries.states`). The layer is left behind."""
        return self.layer.method.gather_state(self.layer.state, self.layer.kv.settle_order())

    @classmethod
    def resumed(cls, method: EvictionMethod, slot_positions: torch.Tensor, state: Any, told: int,
                prompt_tokens: int) -> LiveInPlace:
        """The layer resumed from the request's slot positions `(layers, h, stored)` and its `state` (position order)
        after `told` tokens, in slot order, the slot after them free for the step's token."""
        n_layers, h, stored = slot_positions.shape
        if state is not None:  # position order -> slot order (slot j: the rank of its position), the free slot's afresh
            rank = slot_positions.argsort(dim=-1).argsort(dim=-1)
            state = method.gather_state(state, torch.cat([rank, rank[..., :1]], dim=-1))
            state = method.free_state(state, torch.full((n_layers, h), stored))
        positions = torch.cat([slot_positions, torch.full((n_layers, h, 1), told)], dim=-1)
        return cls.on_slots(method, positions, state, told, prompt_tokens)

    @classmethod
    def on_slots(cls, method: EvictionMethod, positions: torch.Tensor, state: Any, seen: int,
                 prompt_tokens: int) -> LiveInPlace:
        """A layer on stand-in keys whose rows hold the slot positions `positions` `(rows, h, stored + 1)`, the last
        slot free (the next step's token goes there), and the method's `state` in that order (None: a fresh one),
        after `seen` tokens of a prompt of `prompt_tokens`."""
        cache = TrimCache(method)
        layer = TrimLayer(method, 0, owner=cache)
        cache.layers.append(layer)
        stand_in = torch.zeros(*positions.shape, 1)
        layer.resume(stand_in, stand_in.clone(), positions, seen, prompt_tokens if seen >= prompt_tokens else None,
                     layer.state if state is None else state, free_slot=positions.shape[-1] - 1)
        return cls(cache)


def in_place_decode_step(kv_caches, block_ids, live: LiveInPlace, last, scale: float, layout: BlockLayout = cpu_vec,
                          probs: torch.Tensor | None = None) -> tuple[int, LiveInPlace | None, torch.Tensor, Any]:
    """One decode step of a request on its in-place `live` layer, every layer as one batch (`live_decode_step`'s
    arguments): the step's probabilities, in slot order as they come, go to the method
    (`hand_over`); an entry evicted from each layer and KV head leaves its slot to the step's token, moved there
    in the pool and in the layer. Returns the kept count, the live layer after the step (None when the method
    evicted otherwise: then decided as `LiveDecode` does), the slot positions `(layers, h, kept)` and the state
    in the order they say (the layer's, or position order when it is None)."""
    layer = live.layer
    n_layers, h, old = live.slot_positions.shape
    query = (last if isinstance(last, torch.Tensor) else torch.stack(last)).to(kv_caches[0].dtype)
    probs = step_probabilities(kv_caches, block_ids, old + 1, query, scale, layout, probs)
    stand_in = torch.zeros(1, 1, 1, 1).expand(n_layers, h, 1, 1)
    with live.cache.phase(Phase.DECODE):
        full = live.cache.update(stand_in, stand_in, 0)
    before = layer.kv.positions  # (layers, h, old + 1): the slots' positions, the step's token's included
    hand_over(layer, Phase.DECODE, 1, full, None, query, scale, probs)
    free = getattr(layer.kv, "free_slots", None)
    if free is not None and layer.kv.width == old:  # one entry left each row: the step's token takes its slot
        rows = (free != old).flatten().nonzero()[:, 0]
        if rows.numel():
            move_slots(layout, kv_caches, block_ids, rows // h, rows % h, torch.full_like(rows, old),
                       free.flatten()[rows])
        layer.fill_free_slots_from_last()
        return old, live, live.slot_positions, layer.state
    if layer.kv.width == old + 1 and free is None:  # nothing evicted
        return old + 1, live, live.slot_positions, layer.state
    # evicted otherwise (never at a decode step of TOVA or H2O within their schedule): the kept entries fill the
    # slots below the kept count, as any compaction does; the layer, now in position order, is left behind
    kept, n_keep = kept_slots(layer, before)
    order = move_layers_entries(layout, kv_caches, block_ids, kept, n_keep)
    layer.settle()
    return n_keep, None, before.gather(-1, order), layer.state
