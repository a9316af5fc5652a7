"""The decode steps of a step's requests under one method decided as one batch (`LiveBatch`), for methods that read
only their probabilities there (`attention_only_decode`: TOVA, H2O, LazyEviction).

One request's decode step (`kvtrim.vllm.live`) costs about 0.7 ms of operations whose cost does not grow with its
entries (the method's rule, the move, the layer's bookkeeping: ~40 small operations); with 11 requests that is most
of a step's eviction time. Here the requests of one group (the same method and parameters, the same stored count,
the same prompt length where the budget follows from it, and what of the method's state is shared by its rows:
LazyEviction's count of decode steps) are rows of one decision layer of the method's kind (`live_layer_kind`),
request-major (request `r`'s layer `l` is row `r * layers + l`): the step's probabilities of every member (kvtrim's
attention backend computed them) go through one run of the method's rule. A method that evicts in place (TOVA, H2O:
`LiveInPlace`, in the blocks' slot order) then has one set of moves (`move_table_slots`, each request in its own
blocks) and one refill of the freed slots; LazyEviction (`LiveDecode`) moves nothing between its evictions and,
every `window` steps, each member's kept entries in its own blocks (into position order).

Rows of different requests share the layer's count of tokens seen, so each request's positions are rebased by a
shift (`shifts`: its newest token is at the layer's `seen - 1`): rules relative to `seen` (H2O's recent window)
and ties broken by position order hold as they do for the request alone. The batch lasts as long as its members
step together; a request that leaves (it finishes, is preempted, or its forward is anything but a decode step)
takes its rows back (`BatchRows.detach`) and the others form a new batch at their next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvtrim.cache import TrimLayer
from kvtrim.methods.base import EvictionMethod, Phase, check
from kvtrim.vllm.block_io import move_layers_into, move_table_slots
from kvtrim.vllm.block_layout import BlockLayout
from kvtrim.vllm.decide import hand_over
from kvtrim.vllm.entries import RequestEntries
from kvtrim.vllm.live import LiveDecode, LiveInPlace, decided_decode_step, live_layer_kind
from kvtrim.vllm.planning import Due


@dataclass
class LiveBatch:
    """The decision layer of a group's requests `members` (their ids, in row order): a `LiveInPlace` (its last slot
    free after each step, for the next step's token) or a `LiveDecode` whose rows are `members * layers`,
    request-major, on stand-in keys, positions rebased by `shifts` (one per member: a request's position + its
    shift)."""

    live: LiveInPlace | LiveDecode
    members: list[str]
    shifts: list[int]
    n_layers: int

    @property
    def layer(self) -> TrimLayer:
        return self.live.layer

    @property
    def stored(self) -> int:
        """Entries each member stores before its next step's token."""
        return self.live.slot_positions.shape[-1]

    def rows(self, index: int) -> torch.Tensor:
        """Member `index`'s rows `(layers,)`."""
        return torch.arange(index * self.n_layers, (index + 1) * self.n_layers)

    @classmethod
    def formed(cls, method: EvictionMethod, members: list[str], lives: list, prompt_tokens: int,
               n_layers: int) -> LiveBatch:
        """The batch of requests `members` from their decision layers `lives` (each the method's `live_layer_kind`,
        a `LiveInPlace` with its last slot free, or a `BatchRows` of an earlier batch), all storing the same count."""
        parts = [live.own_rows() if isinstance(live, BatchRows) else (live.slots, live.layer.state, live.layer.seen)
                 for live in lives]
        width = parts[0][0].shape[-1]
        check(all(p.shape[-1] == width for p, _, _ in parts), "the requests of one batch store different counts")
        seen = max(told for _, _, told in parts)
        shifts = [seen - told for _, _, told in parts]
        positions = torch.cat([p + shift for (p, _, _), shift in zip(parts, shifts)])
        live = live_layer_kind(method).on_slots(method, positions, method.stack_states([s for _, s, _ in parts]),
                                                seen, prompt_tokens)
        return cls(live, list(members), shifts, n_layers)


@dataclass
class BatchRows:
    """A request's decision layer while its decode steps are decided in `batch` (its `entries.live`): member
    `index`. Its `entries.positions` and `entries.states` are stale meanwhile: `detach` brings them back."""

    batch: LiveBatch
    index: int

    def own_rows(self) -> tuple[torch.Tensor, Any, int]:
        """Its slot positions `(layers, h, stored [+ 1])` (as the batch's `live.slots`: a free last slot
        included), its state as the batch's layer holds it and the tokens it has seen: copies of its rows, shift
        undone."""
        batch, rows = self.batch, self.batch.rows(self.index)
        layer, shift = batch.layer, batch.shifts[self.index]
        return (batch.live.slots.index_select(0, rows) - shift, layer.method.state_rows(layer.state, rows),
                layer.seen - shift)

    def detach(self, entries: RequestEntries, prompt_tokens: int) -> None:
        """Give the request its own decision layer again (of its rows) and its `entries`' positions and states as
        that layer has them (`kvtrim.vllm.compact` then goes on as after its own decode step)."""
        positions, state, seen = self.own_rows()
        method = self.batch.layer.method
        entries.live = live_layer_kind(method).on_slots(method, positions, state, seen, prompt_tokens)
        entries.positions = list(entries.live.slot_positions.unbind(0))
        entries.states = [state] * positions.shape[0]


def batch_key(method: EvictionMethod, stored: int, prompt_tokens: int, state: Any) -> tuple:
    """What the requests of one batch share: the method and its parameters, the entries stored before the step,
    the prompt's length unless the method's budget is fixed before it (a ratio's budget follows from it), and what
    of the method's `state` is not per row (`EvictionMethod.state_key`: LazyEviction's count of decode steps)."""
    fixed = getattr(method, "fixed_budget", lambda: None)()
    return (type(method), method.describe(), stored, None if fixed is not None else prompt_tokens,
            method.state_key(state))


def batch_decode_step(kv_caches: list[torch.Tensor], tables: torch.Tensor, batch: LiveBatch, probs: torch.Tensor,
                      queries: torch.Tensor, scale: float, layout: BlockLayout) -> None:
    """One decode step of every member of `batch` (`in_place_decode_step` for all of them at once): the step's
    probabilities `probs` `(members * layers, q_heads, 1, stored + 1)` (slot order, from kvtrim's attention backend) and its
    `queries` `(members * layers, q_heads, 1, head_dim)`; `tables` `(members, U)` their blocks. The one entry the
    method evicts per row leaves its slot to the step's token, in the blocks and in the layer alike."""
    layer = batch.layer
    rows, h, slots = layer.kv.positions.shape
    check(probs.shape[0] == rows and probs.shape[-1] == slots,
          f"the step's probabilities {tuple(probs.shape)} do not cover the batch's {rows} rows of {slots} entries")
    stand_in = torch.zeros(1, 1, 1, 1).expand(rows, h, 1, 1)
    with batch.live.cache.phase(Phase.DECODE):
        full = batch.live.cache.update(stand_in, stand_in, 0)
    hand_over(layer, Phase.DECODE, 1, full, None, queries, scale, probs)
    free = getattr(layer.kv, "free_slots", None)
    check(free is not None and layer.kv.width == slots - 1,
          f"{type(layer.method).__name__} evicted other than one entry per layer and KV head at a decode step "
          "decided in a batch")
    moved = (free != slots - 1).flatten().nonzero()[:, 0]  # (row, head) flattened: a row whose free slot is not last
    if moved.numel():
        row = moved // h
        move_table_slots(layout, kv_caches, tables, row // batch.n_layers, row % batch.n_layers, moved % h,
                         torch.full_like(moved, slots - 1), free.flatten()[moved])
    layer.fill_free_slots_from_last()


def batch_stored(entries: RequestEntries, method: EvictionMethod, due: Due, has_probs: bool) -> int | None:
    """The entries a request stores before its step's token when its compaction `due` can be decided in a batch, else
    None: a method fed only its probabilities at decode steps (`attention_only_decode`), one decode step whose
    probabilities kvtrim's attention backend computed (`has_probs`), nothing to copy or register, and a decision
    layer where the request is: its own (the method's `live_layer_kind`; a `LiveInPlace` with its last slot free)
    or its batch's rows. A method that evicts in place keeps the count the scheduler planned (one entry out per layer
    and KV head); any other's count is checked after the step (`decide_group`)."""
    if not (method.attention_only_decode and has_probs and not due.copies and due.registers is None
            and len(due.steps) == 1 and due.steps[0].phase is Phase.DECODE and entries.hole is None):
        return None
    live, told = entries.live, due.end - 1
    if isinstance(live, BatchRows):
        stored = live.batch.stored
        follows = live.batch.layer.seen - live.batch.shifts[live.index] == told
    elif isinstance(live, live_layer_kind(method)):
        stored = live.slot_positions.shape[-1]
        follows = live.follows(told, entries.m, entries.states[0])
        if isinstance(live, LiveInPlace):
            free = getattr(live.layer.kv, "free_slots", None)  # its last slot free: the step's token goes there
            follows = follows and free is not None and bool((free == stored).all())
    else:
        return None
    return stored if follows and (due.end - due.discarded == stored or not method.in_place_decode) else None


def batch_groups(due: list, request, prob_index: dict, one_scale: bool) -> tuple[list[list], list]:
    """This step's compactions `due` `(req_id, Due, end)` split into the groups of two or more that are decided as
    one batch each (`batch_key`) and the rest; `request(req_id)`: its `WorkerRequest`; `prob_index`: the requests
    whose step's probabilities kvtrim's attention backend computed; `one_scale`: every layer has the same softmax scale."""
    groups: dict[tuple | None, list] = {}
    for item in due:
        try:
            req = request(item[0])
            stored = (batch_stored(req.entries, req.method, item[1], item[0] in prob_index)
                      if one_scale and item[1].end == item[2] else None)  # (else `compact` says the plan is off)
            key = None if stored is None else batch_key(req.method, stored, req.prompt_tokens, _state(req.entries.live))
        except Exception:  # noqa: BLE001 - its method's code: decided alone, where what it raises fails it alone
            key = None
        groups.setdefault(key, []).append(item)
    rest = groups.pop(None, [])
    for key in [key for key, items in groups.items() if len(items) == 1]:
        rest += groups.pop(key)
    return list(groups.values()), rest


def _state(live) -> Any:
    """The method's state on a request's decision layer (its batch's, when in one)."""
    return (live.batch if isinstance(live, BatchRows) else live).layer.state


def batch_live_step(kv_caches: list[torch.Tensor], block_ids: list[torch.Tensor], batch: LiveBatch,
                    probs: torch.Tensor, queries: torch.Tensor, scale: float, layout: BlockLayout) -> None:
    """One decode step of every member of a batch on a `LiveDecode` (`live_decode_step` for all of them at once:
    `decided_decode_step` on the batch's rows), `probs` and `queries` as `batch_decode_step`'s; when the method
    evicts (LazyEviction, every `window` steps), each member's kept entries move in its own blocks `block_ids`."""

    def move(order: torch.Tensor) -> None:
        for i, blocks in enumerate(block_ids):
            move_layers_into(layout, kv_caches, blocks, order.index_select(0, batch.rows(i)))

    _, batch.live = decided_decode_step(batch.live, probs, queries, scale, move)


def decide_group(kv_caches: list[torch.Tensor], reqs: list, ids: list[str], block_ids: list[list[int]],
                 ends: list[int], tap, scale: float, layout: BlockLayout) -> int:
    """The decode steps of a group of requests `ids` (their `WorkerRequest`s `reqs`, blocks `block_ids`, tokens `ends`
    after the step) on their batch: the one their rows are in when it holds exactly them in this order, else one
    formed from their decision layers; their probabilities and queries taken from the attention backend's `tap`
    (`QueryTap.take_prob_rows`). Returns the entries each stores afterwards (the caller checks it against each
    member's plan: a member whose plan differs fails alone)."""
    lives = [req.entries.live for req in reqs]
    batch = getattr(lives[0], "batch", None)
    if batch is None or batch.members != ids or any(getattr(live, "batch", None) is not batch for live in lives):
        batch = LiveBatch.formed(reqs[0].method, ids, lives, reqs[0].prompt_tokens, len(kv_caches))
    probs, queries = tap.take_prob_rows(ids, batch.stored + 1)
    if isinstance(batch.live, LiveInPlace):
        width = max(len(b) for b in block_ids)
        tables = torch.tensor([b + b[:1] * (width - len(b)) for b in block_ids])  # padded with a block of its own
        batch_decode_step(kv_caches, tables, batch, probs, queries, scale, layout)
    else:
        batch_live_step(kv_caches, [torch.tensor(b) for b in block_ids], batch, probs, queries, scale, layout)
    for index, (req, end) in enumerate(zip(reqs, ends)):
        req.entries.live, req.entries.seen = BatchRows(batch, index), end
    return batch.stored
