"""A request's compactions: what a `TrimCache` keeps, applied to the request's vLLM blocks.

Each forward of a request is told to the method as `model.generate(..., cache=TrimCache(method))` tells it
(`forward_steps`): nothing while the prompt is still being computed (vLLM's prefill chunks attend to all of
it: in the engine the prompt is one block); the forward that completes the prompt is one prompt forward
that ends it (`Phase.PREFILL, ends_prompt=True`, as the one-shot prefill); tokens after the prompt in that
forward (a recomputed request's generated tokens) and every later forward are an append (several tokens)
or a decode step (one). A method with a prefill block (`prompt_block`: KeyDiff `budget=`, SnapKV
`budget=:block_size=`) reads its prompt in blocks instead, as `kvtrim.prefill` does: the scheduler never lets a forward cross a block's end
(`block_end`), and the forward that completes a block tells the method the whole block (a prompt forward,
ending the prompt on the last one), which evicts after it; later forwards attend to what it kept. Attend,
then evict: vLLM attended to everything before the compaction runs.

Two things follow a request through its forwards:

* `StoredCounts` (the scheduler: the one authority for counts): the method's own `target` on the counts
  when its schedule alone decides them (KeyDiff, StreamingLLM, KNorm, and SnapKV, TOVA, H2O, whose attention
  picks only which entries: no tensors, 7-21 µs a step), else the
  method run on stand-in keys (one layer, one KV head, head_dim 8): how many entries the request stores
  after each forward, and which forwards change anything (`due`). The methods the engine runs keep counts that depend on token counts
  only (`kvtrim.vllm.spec`), so the scheduler frees blocks by these counts and tells the worker, with each
  step's `SchedulerOutput` (`PLAN_ATTR`), which requests to compact and the count each must reach; the
  worker applies the method and checks its real count against it (a disagreement ends that request only).
* `RequestEntries` (worker): the positions of the request's stored entries per layer and the method's
  per-layer state, as of its last compaction. At a due forward, `compact` reads the stored keys and values
  from the blocks, resumes a `TrimCache` with them in position order (`TrimLayer.resume`), feeds it the
  forward's steps on the real new entries, and moves only the kept entries that lie past the kept count
  into the slots evicted entries left (`fill_holes`; a StreamingLLM decode step moves nothing: the slot it
  evicts, the same in every layer and KV head, takes the next token, `RequestEntries.fill_hole`): no method is
  implemented a second time. Stored order is then not token order, which attention
  over stored entries does not see (RoPE is in the keys); the positions per slot are kept beside them.

Forwards that are not due are not shown to the real method (reading a request's whole cache at every
decode step would cost more than the step). That is exact for methods whose hooks, on a forward that
evicts nothing, leave their state as it was: the stand-in marks a forward due when it evicts or when
its state changes (a state that cannot be compared, e.g. tensors, makes every forward due).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from kvtrim.attention import attend_with_probabilities, softmax_probabilities
from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import EvictionMethod, Phase, ScoringMethod, check
from kvtrim.methods.h2o import prompt_attention_sums
from kvtrim.vllm import layout as cpu_vec
from kvtrim.vllm.block_layout import BlockLayout
from kvtrim.vllm.layout import slot_places

#: the attribute of a step's `ModelRunnerOutput` where the worker hands the scheduler the requests whose
#: compaction failed (req_id -> why, one line): the scheduler ends them with an error
FAILED_ATTR = "kvtrim_failed"

#: the attribute of a step's `SchedulerOutput` where the scheduler hands the worker its `StepPlan`
PLAN_ATTR = "kvtrim_plan"

#: one step of a forward as the method sees it: (phase, ends the prompt, tokens)
Step = tuple[Phase, bool, int]


@dataclass(frozen=True)
class Due:
    """A forward after which a request is compacted: its `steps` (`forward_steps`), the request's token
    count `end` after it, and the entries it must have `discarded` by then (the scheduler's count)."""

    steps: list[Step]
    end: int
    discarded: int


@dataclass(frozen=True)
class StepPlan:
    """What the scheduler planned for one step: the requests the worker compacts after its forward
    (req_id -> `Due`) and the seconds the planning took (the worker counts them as eviction time)."""

    due: dict[str, Due]
    seconds: float


def prompt_block(method: EvictionMethod | None) -> int | None:
    """The block the engine reads `method`'s prompt in (`prefill_block_size()`: KeyDiff `budget=`), or None when
    the prompt is one block (however vLLM chunks it, the method is told it once, when it is complete)."""
    return None if method is None else method.prefill_block_size()


def block_end(computed: int, prompt_tokens: int, block: int) -> int:
    """Where the block holding token `computed` ends, for a request read in blocks of `block` tokens: the
    prompt in blocks from token 0 (the last one ends with the prompt), then the tokens after it (a recomputed
    request's) in blocks from the prompt's end. The scheduler never lets a forward cross one of these ends, so
    a block is attended to as one forward would attend to it whatever vLLM's chunking (nothing is evicted
    inside it): the kept set does not depend on other traffic."""
    if computed < prompt_tokens:
        return min(prompt_tokens, (computed // block + 1) * block)
    return prompt_tokens + ((computed - prompt_tokens) // block + 1) * block


def forward_steps(computed: int, end: int, prompt_tokens: int, block: int | None = None) -> list[Step]:
    """The steps a forward computing a request's tokens `computed`..`end - 1` is to its method (module
    docstring); `[]` while the prompt (or, with a prompt `block`, the prompt block) is not complete. With a
    `block`, the forward must not cross a block's end without stopping there (`block_end`): the step is the
    whole block, told when its last token is computed."""
    if end <= computed:
        return []
    steps: list[Step] = []
    start = computed
    if computed < prompt_tokens:
        if block is None:
            if end < prompt_tokens:
                return []
            steps.append((Phase.PREFILL, True, prompt_tokens))
        else:
            stop = block_end(computed, prompt_tokens, block)
            check(end <= stop, f"a forward of tokens {computed}..{end - 1} crosses the end of its prompt block at {stop}")
            if end < stop:
                return []
            steps.append((Phase.PREFILL, stop == prompt_tokens, stop - (stop - 1) // block * block))
        start = min(end, prompt_tokens)
    if end > start:
        steps.append((Phase.APPEND if end - start > 1 else Phase.DECODE, False, end - start))
    return steps


def _changed(before: Any, after: Any) -> bool:
    if before is _UNCOMPARABLE:
        return True
    try:
        return bool(before != after)
    except Exception:  # noqa: BLE001 - a state that cannot be compared (tensors): treat it as changed
        return True


def _comparable(state: Any) -> bool:
    """False for a state that holds tensors (itself, or among its attributes or items): `_changed` could not
    compare it."""
    parts = vars(state).values() if hasattr(state, "__dict__") else state if isinstance(state, (list, tuple)) else [state]
    return not any(isinstance(p, torch.Tensor) for p in parts)


#: a state `_changed` treats as changed whatever it is compared with
_UNCOMPARABLE = object()


@dataclass
class _Counts:
    """The part of a `LayerView` that `ScoringMethod.target` reads: counts, no tensors."""

    phase: Phase
    prompt_end: bool
    prompt_tokens: int | None
    stored: int


class StoredCounts:
    """How many entries a request stores under `method`, from its token counts alone (module docstring).
    A method whose counts follow its schedule (`ScoringMethod.counts_by_schedule`: KeyDiff, StreamingLLM,
    KNorm; or `counts_ignore_attention`: SnapKV, TOVA, H2O, whose attention picks which entries, never how
    many) is counted without keys (its `target` on the counts), one whose count is a function of the tokens
    seen (`stored_after`: LagKV's reference mode) by it; any other runs on the stand-in keys (LazyEviction, a
    method with `skip_layers`; one fed attention gets stand-in queries and probabilities, as the worker hands
    it the real ones)."""

    def __init__(self, method: EvictionMethod):
        self.method = method
        self.by_count = isinstance(method, ScoringMethod) and (method.counts_by_schedule()
                                                               or method.counts_ignore_attention)
        #: a method with a per-layer state (H2O's accumulated attention) changes it at every forward it is told:
        #: counted by schedule, each such forward is due (the worker runs it and carries the state)
        self.stateful = self.by_count and method.new_state(0) is not None
        #: counted by `stored_after` (LagKV's reference mode): the count is a function of the tokens seen
        self.by_length = not self.by_count and method.stored_after(0) is not None
        self.seen = self.stored = 0
        self.prompt_tokens: int | None = None
        self.cache = TrimCache(method, in_place_decode=False)
        self._gen = torch.Generator().manual_seed(0)

    @property
    def _layer(self) -> TrimLayer | None:
        return self.cache.layers[0] if self.cache.layers else None

    @property
    def discarded(self) -> int:
        """Entries discarded so far (tokens seen minus entries stored)."""
        if self.by_count or self.by_length:
            return self.seen - self.stored
        layer = self._layer
        return 0 if layer is None else layer.seen - layer.stored

    @property
    def held(self) -> int:
        """Entries stored now (of the tokens told so far)."""
        if self.by_count or self.by_length:
            return self.stored
        layer = self._layer
        return 0 if layer is None else layer.stored

    def advance(self, steps: list[Step]) -> bool:
        """Tell the counts a forward's `steps`; True when the forward is due (it evicts, or changes the
        method's state): the worker must run the method on it."""
        if self.by_length:
            return self._by_length(steps)
        return self._count(steps) if self.by_count else self._stand_in(steps)

    def _by_length(self, steps: list[Step]) -> bool:
        self.seen += sum(q for _, _, q in steps)
        stored, self.stored = self.stored + sum(q for _, _, q in steps), self.method.stored_after(self.seen)
        return self.stored < stored

    def _count(self, steps: list[Step]) -> bool:
        due = self.stateful and bool(steps)
        for phase, ends, q in steps:
            self.seen += q
            self.stored += q
            if ends:
                self.prompt_tokens = self.seen
            n_keep = self.method.target(_Counts(phase, ends, self.prompt_tokens, self.stored))
            if n_keep is not None and self.stored > n_keep:
                self.stored, due = n_keep, True
        return due

    def _stand_in(self, steps: list[Step]) -> bool:
        due = False
        for phase, ends, q in steps:
            layer = self._layer
            evictions = 0 if layer is None else layer.evictions
            state = self.cache.method.new_state(0) if layer is None else layer.state
            # a state that cannot be compared counts as changed (`_changed`): no copy to compare it with
            state = _UNCOMPARABLE if not _comparable(state) else copy.deepcopy(state)
            k, v = torch.randn(2, 1, 1, q, 8, generator=self._gen)
            with self.cache.phase(phase, ends_prompt=ends):
                full = self.cache.update(k, v, 0)
            layer = self._layer
            if layer.awaiting_attention:  # stand-in queries, handed over as the worker's compaction hands them
                step = torch.randn(1, 1, q, 8, generator=self._gen) if self.method.needs_attention else None
                prompt = self._queries(q) if phase is Phase.PREFILL else None
                _hand_over(layer, phase, q, full, prompt, step, 8 ** -0.5)
            due = due or layer.evictions != evictions or _changed(state, layer.state)
        return due

    def _queries(self, q: int) -> torch.Tensor:
        """Stand-in queries `(1, 1, W, 8)` of a prompt block's step of `q` tokens: its last `prompt_queries()`
        positions (what the worker hands over, `kvtrim_prompt_queries`)."""
        return torch.randn(1, 1, min(q, self.method.prompt_queries() or q), 8, generator=self._gen)


def plan_forward(all_counts: dict[str, StoredCounts], req_id: str, method: EvictionMethod, computed: int,
                 end: int, prompt_tokens: int) -> Due | None:
    """Tell request `req_id`'s counts (created in `all_counts` at its first forward; a request that starts
    over, `computed == 0`, starts afresh) a forward computing its tokens `computed`..`end - 1`: the `Due`
    compaction after it, or None when the method does nothing there."""
    if computed == 0:
        all_counts.pop(req_id, None)
    steps = forward_steps(computed, end, prompt_tokens, prompt_block(method))
    if not steps:
        return None
    counts = all_counts.get(req_id)
    if counts is None:
        counts = all_counts[req_id] = StoredCounts(method)
    return Due(steps, end, counts.discarded) if counts.advance(steps) else None


def prompt_peak(method: EvictionMethod, prompt_tokens: int) -> int:
    """The most entries a request holds while its prompt is read (inside a forward, before its eviction):
    the prompt itself when it is one block, else the peak over its blocks (`block_end`), each attending to
    what the blocks before it kept (the counts of `StoredCounts`)."""
    block = prompt_block(method)
    if block is None:
        return prompt_tokens
    counts, peak, start = StoredCounts(method), 0, 0
    while start < prompt_tokens:
        stop = block_end(start, prompt_tokens, block)
        peak = max(peak, counts.held + stop - start)
        counts.advance(forward_steps(start, stop, prompt_tokens, block))
        start = stop
    return peak


def longest_peak(method: EvictionMethod | None, max_len: int) -> int:
    """The most entries one request of at most `max_len` tokens may hold under `method` in the engine, however
    its tokens split between prompt and output (what the server's KV-cache spec reports, so that vLLM's
    start-up check asks the pool for that instead of `max_len`): below `max_len` only for a method that reads
    its prompt in blocks and bounds what it stores while decoding (KeyDiff `budget=`: `budget + block_size`)."""
    if method is None or prompt_block(method) is None:
        return max_len
    worst = prompt_peak(method, max_len - 1)  # a longer prompt's blocks start as a shorter one's: the worst
    for prompt in range(1, max_len):
        peak = method.peak_stored(prompt, max_len)  # (a prefix of a longer output peaks no higher)
        if peak is None:
            return max_len
        worst = max(worst, peak)
    return min(worst, max_len)


@dataclass
class RequestEntries:
    """What the worker knows of a request's stored entries, as of its last compaction: the first `m` stored
    entries (slots) of layer `i` hold the tokens at `positions[i]` `(kv_heads, m)`, in slot order, which
    need not be the tokens' order (compaction fills the slots evicted entries leave with kept entries from
    the end: attention does not depend on where an entry is stored); the entries after them are tokens
    `seen`, `seen + 1`, ... in order. `states`: the method's per-layer state (for the entries in position
    order, as the method keeps it)."""

    positions: list[torch.Tensor] | None = None  # None: nothing compacted yet (entry i is token i)
    seen: int = 0
    states: list[Any] | None = None
    #: a slot below `m` whose entry the last compaction evicted without moving another into it (the same in
    #: every layer and KV head): the next token is written there (`fill_hole`), not after the stored entries
    hole: int | None = None
    #: a positions-only method's decision layer after a decode step that left a hole (`TrimCache` of one layer
    #: on stand-in keys in slot order, its free slot the hole: `_live_layer`): the next decode step runs on it
    #: in place instead of on a layer resumed from the positions; any other compaction drops it
    live: TrimCache | None = None

    @property
    def m(self) -> int:
        return 0 if self.positions is None else self.positions[0].shape[-1]

    def fill_hole(self, position: int) -> int | None:
        """The request's next token (at `position`) is written into the hole, if there is one: returns its slot
        (None: no hole, the token goes after the stored entries) and records the token there."""
        if self.hole is None:
            return None
        check(position == self.seen, f"a hole was left at token {self.seen}, the next token is at {position}")
        assert self.positions is not None
        hole, self.hole, self.seen = self.hole, None, position + 1
        self.positions = _per_tensor(self.positions, lambda p: p.index_fill(-1, torch.tensor([hole]), position))
        return hole

    def slots(self, layer: int) -> torch.Tensor:
        """The positions `(kv_heads, m)` of the tokens in layer `layer`'s first `m` slots, -1 at the hole."""
        assert self.positions is not None
        if self.hole is None:
            return self.positions[layer]
        return self.positions[layer].index_fill(-1, torch.tensor([self.hole]), -1)


def fill_holes(kept: torch.Tensor, n_keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which entries move so that the `n_keep` kept entries of each row of `kept` `(kv_heads, stored)` (bool,
    `n_keep` True per row) occupy slots `0..n_keep - 1`: each slot below `n_keep` that lost its entry takes a
    kept entry from a slot at or past `n_keep` (both in slot order). Returns the moves, `heads`, `from_slots`,
    `to_slots` `(moves,)` each, and `order` `(kv_heads, n_keep)`: afterwards slot `j` of head `i` holds the
    entry that was at slot `order[i, j]`."""
    holes = (~kept[:, :n_keep]).nonzero()  # (moves, 2): row-major, so each head's holes in slot order ...
    sources = kept[:, n_keep:].nonzero()  # ... and its sources, the same number per head
    heads, to_slots, from_slots = holes[:, 0], holes[:, 1], sources[:, 1] + n_keep
    order = torch.arange(n_keep).expand(kept.shape[0], -1).clone()
    order[heads, to_slots] = from_slots
    return heads, from_slots, to_slots, order


def add_prompt_sums(sums: list[torch.Tensor], kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                    queries: list[torch.Tensor], computed: int, scales: list[float], block: int,
                    layout: BlockLayout = cpu_vec) -> None:
    """Add to each layer's `sums` `(kv_heads, prompt)` float32 the column sums of the causal attention of a prefill
    chunk's queries `(q_heads, rows, head_dim)` (positions `computed .. computed + rows - 1`) over the request's
    keys up to the chunk's last position, by H2O's own rule (`prompt_attention_sums`, in blocks of `block` query
    rows). The sums are additive over query rows: chunk by chunk they are the whole prompt's, without holding its
    queries. Nothing is compacted before such a prompt ends (it is one block): entry `i` is token `i`. `layout`:
    how the caches store their blocks (`kvtrim.vllm.block_layout`)."""
    visible = computed + queries[0].shape[1]
    for kv, q, scale, total in zip(kv_caches, queries, scales, sums):
        keys = layout.read_keys(kv, block_ids, visible)  # (kv_heads, visible, head_dim)
        total[:, :visible] += prompt_attention_sums(q[None], keys[None], scale, block)[0]


def _decide(cache: TrimCache, idx: int, keys: torch.Tensor | None, values: torch.Tensor | None,
            slot_positions: torch.Tensor, old: int, told: int, steps: list[Step], prompt_tokens: int, state: Any,
            queries: torch.Tensor | None = None, scale: float | None = None, last: torch.Tensor | None = None,
            probs: torch.Tensor | None = None, by_position: torch.Tensor | None = None,
            sums: torch.Tensor | None = None):
    """The method's decision on stored entries `(b, h, stored, d)` in slot order (`slot_positions` `(b, h,
    stored)`; the first `old` stored before this forward; keys None for a positions-only method, values None for
    one that reads none: stand-ins): one layer's
    (`b = 1`), or a request's layers as one batch (`layers_alike` methods), as a `TrimLayer` (index `idx`)
    resumed from them in position order and fed the forward's `steps`. Returns the layer, what it keeps as a
    slot mask `(b, h, stored)` and the kept count.

    A method that waits for its attention (`needs_queries`: SnapKV) gets it after each step as kvtrim's
    attention hands it over in transformers (`TrimLayer.after_attention`): `queries` `(b, q_heads, W,
    head_dim)`, the prompt block's last post-RoPE queries, with the step that ends the block (the prompt's, for
    a method that reads it in one), and the layer's softmax `scale`. A method that `needs_attention` (TOVA, H2O, LazyEviction) gets `last` `(b, q_heads, q, head_dim)`, the queries of
    the step after the prompt (a decode step: with its probabilities over the layer's entries after the step's
    append, computed here as kvtrim's attention computes them, `attend_with_probabilities`; an append: its
    queries, as kvtrim's attention hands them). Any other step gets None. `probs` `(b, q_heads, 1, stored)` in
    position order: a decode step's probabilities computed by the caller (then keys may be None: stand-ins);
    `by_position`: `slot_positions.argsort(dim=-1)` when the caller has it already; `sums` `(b, kv_heads,
    prompt)`: instead of `queries`, the prompt's attention column sums (`kvtrim.vllm.spec.prompt_sums`: H2O),
    handed over with the step that ends the prompt."""
    b, h, stored = slot_positions.shape
    # the method sees the entries in position order (this forward's tokens last: theirs are the latest positions,
    # wherever they lie: the first may have filled a hole)
    if by_position is None:
        by_position = slot_positions.argsort(dim=-1)
    sorted_positions = slot_positions.gather(-1, by_position)
    real = keys if keys is not None else values
    if real is None:  # a positions-only method: stand-ins, it reads no keys or values
        keys = values = torch.zeros(1, 1, 1, 1).expand(b, h, stored, 1)
    else:  # whole rows: index_select is far faster than gather
        rows = (by_position + stored * torch.arange(b * h).view(b, h, 1)).flatten()
        # stand-in values (of the keys' dtype) for a method that reads none (`reads_values`)
        keys, values = (torch.zeros(1, 1, 1, 1, dtype=real.dtype).expand(b, h, stored, 1) if t is None
                        else t.reshape(b * h * stored, -1).index_select(0, rows).view(b, h, stored, -1)
                        for t in (keys, values))
    layer = TrimLayer(cache.method, idx, owner=cache, in_place_decode=False)
    cache.layers.append(layer)
    if told:
        ended = prompt_tokens if told >= prompt_tokens else None  # resumed inside the prompt (blocks): not ended
        layer.resume(keys[:, :, :old], values[:, :, :old], sorted_positions[:, :, :old], told, ended,
                     layer.state if state is None else state)
    start = old
    for phase, ends, q in steps:
        with cache.phase(phase, ends_prompt=ends):
            full = cache.update(keys[:, :, start:start + q], values[:, :, start:start + q], len(cache.layers) - 1)
        if layer.awaiting_attention:  # attend, then evict: the hand-over of kvtrim's attention
            _hand_over(layer, phase, q, full, queries if phase is Phase.PREFILL else None, last, scale, probs,
                       sums if ends else None)
        start += q
    check(not layer.is_ragged, f"{type(cache.method).__name__} kept different numbers of entries per KV head, which "
                               "vLLM's shared block table cannot hold")
    pos = layer.positions  # (b, h, n_keep), ascending
    if pos.shape[-1] == stored:  # nothing evicted
        return layer, torch.ones(b, h, stored, dtype=torch.bool), stored
    kept_slots = by_position.gather(-1, torch.searchsorted(sorted_positions, pos.contiguous()))
    return layer, torch.zeros(b, h, stored, dtype=torch.bool).scatter_(-1, kept_slots, True), pos.shape[-1]


def _hand_over(layer: TrimLayer, phase: Phase, q: int, full: tuple[torch.Tensor, torch.Tensor],
               prompt: torch.Tensor | None, step: torch.Tensor | None, scale: float | None,
               probs: torch.Tensor | None = None, sums: torch.Tensor | None = None) -> None:
    """Hand a layer that waits for its attention what kvtrim's attention hands it in transformers after a step of
    `q` tokens (`full`: the layer's keys and values after the step's append): with a prompt block's step (the
    whole prompt's, unless the method reads it in blocks), the block's last queries `prompt`; with a step after
    the prompt, its queries `step` (`(b, q_heads, q, head_dim)`, methods that need attention) and, for a decode
    step, the probabilities they attend with; else nothing (a decode step's `probs`, when the caller computed
    them: those). `sums`: the prompt's attention column sums instead of queries (H2O in the engine). The worker's
    compaction and the scheduler's stand-in both hand over through this one rule."""
    if phase is Phase.PREFILL:
        layer.after_attention(prompt, None, scale, sums)
    elif step is not None:
        if probs is None and q == 1:
            probs = attend_with_probabilities(step, *full, None, scale)[1]
        layer.after_attention(step, probs if q == 1 else None, scale)
    else:
        layer.after_attention(None, None, scale)


def compact(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, method: EvictionMethod,
            entries: RequestEntries, steps: list[Step], end: int, prompt_tokens: int,
            queries: list[torch.Tensor] | None = None, scales: list[float] | None = None,
            last: list[torch.Tensor] | None = None, sums: list[torch.Tensor] | None = None,
            layout: BlockLayout = cpu_vec) -> int:
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
    (the block's last `W` post-RoPE queries, what the worker's attention tap captured) and the layers' softmax `scales` (`_decide`). A method that needs the attention of its decode
    steps (TOVA, H2O, LazyEviction) gets, with a forward after the prompt, `last` per layer `(q_heads, q,
    head_dim)`: the queries of its tokens after the prompt, from which `_decide` computes a decode step's
    probabilities. H2O gets, with the forward that ends the prompt, `sums` per layer `(kv_heads, prompt)` instead
    of queries: its prompt's attention column sums, which the worker adds up chunk by chunk.

    `layout`: how the caches store their blocks (`kvtrim.vllm.block_layout`; default vLLM's CPU kernel "vec")."""
    check(entries.hole is None, "the request's hole was not filled before its next compaction")
    told = end - sum(q for _, _, q in steps)  # tokens the method was told before this forward
    stored = entries.m + end - entries.seen
    old = stored - (end - told)  # entries stored before this forward's tokens
    h, n_layers = kv_caches[0].shape[1], len(kv_caches)
    slot_positions = _extended(entries.positions, torch.arange(entries.seen, end).expand(h, -1), n_layers)
    states = entries.states or [None] * n_layers
    forward = old, told, steps, prompt_tokens  # what `_decide` needs of the forward besides the entries
    hole = live = None
    previous_live, entries.live = entries.live, None  # kept only by a decode step that leaves a hole again
    if not method.waits_for_attention and method.positions_only and all(
            p is slot_positions[0] or torch.equal(p, slot_positions[0]) for p in slot_positions[1:]):
        n_keep, positions, state, hole, live = _compact_positions_only(method, kv_caches, block_ids, slot_positions[0],
                                                                       states[0], forward, previous_live, layout)
        # one positions tensor for every layer: the next compaction finds them shared at once
        new_positions, new_states, kept_counts = [positions] * n_layers, [state] * n_layers, {n_keep}
    elif method.layers_alike() and _groups_share_states(states, size := _layer_group(method, n_layers)) and (
            scales is None or len(set(scales)) == 1):
        new_positions, new_states, kept_counts = [], [], set()
        # a decode step of a method that reads only its probabilities there: keys alone, stand-ins for the method
        lean = (method.attention_only_decode and last is not None and scales is not None and len(steps) == 1
                and steps[0][0] is Phase.DECODE)
        for first in range(0, n_layers, size):  # groups of layers: small temporaries, reused memory
            group = slice(first, first + size)
            if lean:
                n_keep, positions, state = _compact_decode_step(method, kv_caches[group], block_ids,
                                                                slot_positions[group], states[first], forward,
                                                                last[group], scales[first], layout)
            else:
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
            keys, values = _read(layout, method, kv, block_ids, slot_positions[idx].shape[-1])
            layer, kept, n_keep = _decide(cache, idx, keys[None], None if values is None else values[None],
                                          slot_positions[idx][None], *forward,
                                          states[idx], None if queries is None else queries[idx][None],
                                          None if scales is None else scales[idx],
                                          None if last is None else last[idx][None],
                                          sums=None if sums is None else sums[idx][None])
            heads, from_slots, to_slots, order = fill_holes(kept[0], n_keep)
            if heads.numel():
                _store_moves(layout, kv, block_ids, heads, from_slots, to_slots, keys, values)
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
    layer, kept, n_keep = _decide(TrimCache(method, in_place_decode=False), 0, None, None, slot_positions[None],
                                  *forward, state)
    kept = kept[0]
    lost = (~kept).nonzero()  # (evicted, 2): (head, slot), head-major
    if _leaves_hole(forward[2]) and n_keep == stored - 1 and bool((lost[:, 1] == lost[0, 1]).all()):
        # one entry left, from the same slot in every KV head (and layer): nothing moves, the next token is
        # written there (the worker's `fill_hole`)
        return n_keep, slot_positions, layer.state, int(lost[0, 1]), None
    heads, from_slots, to_slots, order = fill_holes(kept, n_keep)
    if heads.numel():
        block_size = kv_caches[0].shape[2]  # where the moved entries lie: the same in every layer
        source, target = slot_places(block_ids, from_slots, block_size), slot_places(block_ids, to_slots, block_size)
        for kv in kv_caches:
            layout.move_entries(kv, heads, source, target)
    return n_keep, slot_positions.gather(-1, order), layer.state, None, None


def _live_layer(method: EvictionMethod, live: TrimCache | None, slot_positions: torch.Tensor, state: Any,
                forward: tuple) -> TrimCache | None:
    """The one-layer cache a positions-only method's single decode step runs on in place
    (`_compact_positions_only`), or None for any other step or method: `live`, when its layer is where the
    engine is (it has seen the tokens before the step and its free slot is where the engine wrote the step's
    token), else one resumed from the request's positions `(h, stored)` in slot order on stand-in keys (the
    slot the step's token took free)."""
    _, told, steps, prompt_tokens = forward
    if not (method.in_place_decode and state is None and steps == [(Phase.DECODE, False, 1)]):
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
    reads = [_read(layout, method, kv, block_ids, stored) for kv in kv_caches]
    keys = torch.stack([k for k, _ in reads])
    values = None if reads[0][1] is None else torch.stack([v for _, v in reads])
    positions = torch.stack(slot_positions)  # (layers, h, stored)
    cache = TrimCache(method, in_place_decode=False)  # one per batch: a cache's layers share its batch size
    layer, kept, n_keep = _decide(cache, 0, keys, values, positions, *forward, state,
                                  None if queries is None else torch.stack(queries), scale,
                                  None if last is None else torch.stack(last),
                                  sums=None if sums is None else torch.stack(sums))
    moves, order = _fill_layers_holes(kept, n_keep)
    for idx, heads, from_slots, to_slots in moves:
        _store_moves(layout, kv_caches[idx], block_ids, heads, from_slots, to_slots, keys[idx],
                     None if values is None else values[idx])
    return n_keep, list(positions.gather(-1, order).unbind(0)), layer.state


def _read(layout: BlockLayout, method: EvictionMethod, kv_cache: torch.Tensor, block_ids: torch.Tensor,
          n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's first `n` stored keys and values `(h, n, d)` in slot order; keys and None for a method that reads
    no values (`reads_values`): it gets stand-ins (`_decide`) and its kept entries move inside the pool
    (`_store_moves`)."""
    if method.reads_values:
        return layout.read_request(kv_cache, block_ids, n)
    return layout.read_keys(kv_cache, block_ids, n), None


def _store_moves(layout: BlockLayout, kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor,
                 from_slots: torch.Tensor, to_slots: torch.Tensor, keys: torch.Tensor | None = None,
                 values: torch.Tensor | None = None) -> None:
    """Put KV head `heads[i]`'s entry at slot `from_slots[i]` into slot `to_slots[i]` of one layer: written from the
    copies read (`keys`, `values` `(h, stored, d)`, slot order), or, when its values were not read, copied inside
    the pool."""
    if values is None:
        block_size = kv_cache.shape[2]
        layout.move_entries(kv_cache, heads, slot_places(block_ids, from_slots, block_size),
                            slot_places(block_ids, to_slots, block_size))
    else:
        layout.write_entries(kv_cache, block_ids, heads, to_slots, keys[heads, from_slots], values[heads, from_slots])


def _fill_layers_holes(kept: torch.Tensor, n_keep: int) -> tuple[list[tuple], torch.Tensor]:
    """`fill_holes` for a batch of layers `kept` `(layers, kv_heads, stored)`: each layer's moves `(layer, heads,
    from_slots, to_slots)` (layers with none left out) and `order` `(layers, kv_heads, n_keep)`."""
    n_layers, h, stored = kept.shape
    rows, from_slots, to_slots, order = fill_holes(kept.view(n_layers * h, stored), n_keep)  # rows in layer order
    moves = []
    if rows.numel():
        per_layer = torch.bincount(rows // h, minlength=n_layers).tolist()
        for idx, (r, f, t) in enumerate(zip(rows.split(per_layer), from_slots.split(per_layer),
                                            to_slots.split(per_layer))):
            if r.numel():
                moves.append((idx, r - idx * h, f, t))
    return moves, order.view(n_layers, h, n_keep)


def _compact_decode_step(method: EvictionMethod, kv_caches, block_ids, slot_positions: list[torch.Tensor], state: Any,
                         forward: tuple, last: list[torch.Tensor], scale: float, layout: BlockLayout = cpu_vec):
    """`compact` for one decode step of a method that reads only the step's attention probabilities there
    (`attention_only_decode`: TOVA, H2O, LazyEviction) on a group of layers, as one batch: only the keys are read
    (`request_key_logits`, slot order) for the probabilities of each layer's query `last` `(q_heads, 1,
    head_dim)` (`softmax_probabilities`, as kvtrim's attention computes them), which the method gets in
    position order with stand-in keys and values (`_decide`); only the entries that move are copied, in the
    pool (`move_entries`). Returns what `_compact_as_one_batch` returns."""
    h, stored = slot_positions[0].shape
    query = torch.stack(last).to(kv_caches[0].dtype)  # (layers, q_heads, 1, d)
    positions = torch.stack(slot_positions)  # (layers, h, stored)
    by_position = positions.argsort(dim=-1)
    # each query head reads its KV head's entries: in position order, that head's own order
    order = by_position.repeat_interleave(query.shape[1] // h, dim=1)[:, :, None]
    logits = layout.request_key_logits(kv_caches, block_ids, stored, query)
    probs = softmax_probabilities(logits.gather(-1, order), None, scale)
    cache = TrimCache(method, in_place_decode=False)
    layer, kept, n_keep = _decide(cache, 0, None, None, positions, *forward, state, None, scale, query, probs,
                                  by_position)
    if n_keep == stored:  # nothing evicted (LazyEviction between its evictions, H2O within budget)
        return n_keep, list(positions.unbind(0)), layer.state
    moves, order = _fill_layers_holes(kept, n_keep)
    for idx, heads, from_slots, to_slots in moves:  # nothing read but keys: copied inside the pool
        _store_moves(layout, kv_caches[idx], block_ids, heads, from_slots, to_slots)
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


def _per_tensor(tensors: list[torch.Tensor], f) -> list[torch.Tensor]:
    """`f` applied once per distinct tensor of `tensors` (layers that share one positions tensor share the
    result too; all of them at once when they are one tensor, the common case)."""
    if all(t is tensors[0] for t in tensors):
        return [f(tensors[0])] * len(tensors)
    done: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) not in done:
            done[id(t)] = f(t)
    return [done[id(t)] for t in tensors]


def _extended(positions: list[torch.Tensor] | None, new: torch.Tensor, n_layers: int) -> list[torch.Tensor]:
    """Each layer's slot positions `(h, m)` followed by the `new` tokens' `(h, q)` (`_per_tensor`)."""
    if positions is None:
        return [new] * n_layers
    return _per_tensor(positions, lambda p: torch.cat([p, new], dim=-1))


def _leaves_hole(steps: list[Step]) -> bool:
    """A compaction after a forward that ends in a decode step may leave a hole (the next forward's first token
    fills it); it then keeps one slot more than it stores (`slots_held`)."""
    return steps[-1][0] is Phase.DECODE


def slots_held(due: Due) -> int:
    """The slots a request keeps after its compaction at `due` (the scheduler keeps their blocks, the worker its
    block ids): what it stores, plus one after a decode step: the next token's slot (the hole the compaction
    left, or the one after the stored entries), whose block the next step would otherwise take back at once."""
    return due.end - due.discarded + _leaves_hole(due.steps)


def blocks_needed(entries: int, block_size: int) -> int:
    """Blocks that hold a request's first `entries` stored entries (or slots)."""
    return -(-entries // block_size)
