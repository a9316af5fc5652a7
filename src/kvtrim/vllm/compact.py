"""A request's compactions: what a `TrimCache` keeps, applied to the request's vLLM blocks.

Each forward of a request is told to the method as `model.generate(..., cache=TrimCache(method))` tells it
(`forward_steps`): nothing while the prompt is still being computed (vLLM's prefill chunks attend to all of
it: in the engine the prompt is one block); the forward that completes the prompt is one prompt forward
that ends it (`Phase.PREFILL, ends_prompt=True`, as the one-shot prefill); tokens after the prompt in that
forward (a recomputed request's generated tokens) and every later forward are an append (several tokens)
or a decode step (one). Attend, then evict: vLLM attended to everything before the compaction runs.

Two things follow a request through its forwards:

* `StoredCounts` (the scheduler: the one authority for counts): the method's own `target` on the counts
  when its schedule alone decides them (KeyDiff, StreamingLLM, KNorm: no tensors, ~20 µs a step), else the
  method run on stand-in keys (one layer, one KV head, head_dim 8): how many entries the request stores
  after each forward, and which forwards change anything (`due`). The methods the engine runs keep counts that depend on token counts
  only (`kvtrim.vllm.spec`), so the scheduler frees blocks by these counts and tells the worker, with each
  step's `SchedulerOutput` (`PLAN_ATTR`), which requests to compact and the count each must reach; the
  worker applies the method and checks its real count against it (a disagreement ends that request only).
* `RequestEntries` (worker): the positions of the request's stored entries per layer and the method's
  per-layer state, as of its last compaction. At a due forward, `compact` reads the stored keys and values
  from the blocks, resumes a `TrimCache` with them (`TrimLayer.resume`), feeds it the forward's steps on
  the real new entries, and writes what it kept back: no method is implemented a second time.

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

from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import EvictionMethod, Phase, ScoringMethod, check
from kvtrim.vllm.layout import read_request, write_request

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


def forward_steps(computed: int, end: int, prompt_tokens: int) -> list[Step]:
    """The steps a forward computing a request's tokens `computed`..`end - 1` is to its method (module
    docstring); `[]` while the prompt is not complete."""
    if end < prompt_tokens or end <= computed:
        return []
    steps: list[Step] = []
    start = computed
    if computed < prompt_tokens:
        steps.append((Phase.PREFILL, True, prompt_tokens))
        start = prompt_tokens
    if end > start:
        steps.append((Phase.APPEND if end - start > 1 else Phase.DECODE, False, end - start))
    return steps


def _changed(before: Any, after: Any) -> bool:
    try:
        return bool(before != after)
    except Exception:  # noqa: BLE001 - a state that cannot be compared (tensors): treat it as changed
        return True


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
    KNorm) is counted without keys (its `target` on the counts); any other runs on the stand-in keys."""

    def __init__(self, method: EvictionMethod):
        self.method = method
        self.by_count = isinstance(method, ScoringMethod) and method.counts_by_schedule()
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
        if self.by_count:
            return self.seen - self.stored
        layer = self._layer
        return 0 if layer is None else layer.seen - layer.stored

    def advance(self, steps: list[Step]) -> bool:
        """Tell the counts a forward's `steps`; True when the forward is due (it evicts, or changes the
        method's state): the worker must run the method on it."""
        return self._count(steps) if self.by_count else self._stand_in(steps)

    def _count(self, steps: list[Step]) -> bool:
        due = False
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
            state = self.cache.method.new_state(0) if layer is None else copy.deepcopy(layer.state)
            k, v = torch.randn(2, 1, 1, q, 8, generator=self._gen)
            with self.cache.phase(phase, ends_prompt=ends):
                self.cache.update(k, v, 0)
            layer = self._layer
            due = due or layer.evictions != evictions or _changed(state, layer.state)
        return due


def plan_forward(all_counts: dict[str, StoredCounts], req_id: str, method: EvictionMethod, computed: int,
                 end: int, prompt_tokens: int) -> Due | None:
    """Tell request `req_id`'s counts (created in `all_counts` at its first forward; a request that starts
    over, `computed == 0`, starts afresh) a forward computing its tokens `computed`..`end - 1`: the `Due`
    compaction after it, or None when the method does nothing there."""
    if computed == 0:
        all_counts.pop(req_id, None)
    steps = forward_steps(computed, end, prompt_tokens)
    if not steps:
        return None
    counts = all_counts.get(req_id)
    if counts is None:
        counts = all_counts[req_id] = StoredCounts(method)
    return Due(steps, end, counts.discarded) if counts.advance(steps) else None


@dataclass
class RequestEntries:
    """What the worker knows of a request's stored entries, as of its last compaction: the first `m` stored
    entries of layer `i` hold the tokens at `positions[i]` `(kv_heads, m)` (ascending per head); the entries
    after them are tokens `seen`, `seen + 1`, ... in order. `states`: the method's per-layer state."""

    positions: list[torch.Tensor] | None = None  # None: nothing compacted yet (entry i is token i)
    seen: int = 0
    states: list[Any] | None = None

    @property
    def m(self) -> int:
        return 0 if self.positions is None else self.positions[0].shape[-1]


def compact(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, method: EvictionMethod,
            entries: RequestEntries, steps: list[Step], end: int, prompt_tokens: int) -> int:
    """Run a due forward's `steps` (bringing the request's tokens up to `end`; its prompt has `prompt_tokens`) through `method` on the keys
    and values stored in every layer's cache `(num_blocks, kv_heads, block_size, 2 * head_dim)`, write the
    kept entries back in place and update `entries`. Returns the entries discarded so far (every layer and
    KV head the same: vLLM's block table is shared)."""
    told = end - sum(q for _, _, q in steps)  # tokens the method was told before this forward
    stored = entries.m + end - entries.seen
    cache = TrimCache(method, in_place_decode=False)
    new_positions, new_states, kept = [], [], set()
    for idx, kv in enumerate(kv_caches):
        keys, values = read_request(kv, block_ids, stored)  # (h, stored, d)
        h = keys.shape[0]
        first = torch.arange(entries.seen, end).expand(h, -1)
        before = first if entries.positions is None else torch.cat([entries.positions[idx], first], dim=-1)
        layer = TrimLayer(method, idx, owner=cache, in_place_decode=False)
        cache.layers.append(layer)
        old = stored - (end - told)  # entries stored before this forward's tokens
        if told:
            layer.resume(keys[None, :, :old], values[None, :, :old], before[None, :, :old], told,
                         prompt_tokens, entries.states[idx] if entries.states else layer.state)
        start = old
        for phase, ends, q in steps:
            with cache.phase(phase, ends_prompt=ends):
                cache.update(keys[None, :, start:start + q], values[None, :, start:start + q], idx)
            start += q
        check(not layer.is_ragged, f"{type(method).__name__} kept different numbers of entries per KV head, which "
                                   "vLLM's shared block table cannot hold")
        pos = layer.positions[0]  # (h, n_keep), ascending
        n_keep = pos.shape[-1]
        kept.add(n_keep)
        moved = (pos != before[:, :n_keep]).any(dim=0).nonzero()
        if moved.numel():  # entries from the first one that moved on are rewritten
            j = int(moved[0])
            write_request(kv, block_ids, layer.keys[0, :, j:], layer.values[0, :, j:], start=j)
        new_positions.append(pos)
        new_states.append(layer.state)
    check(len(kept) == 1, f"{type(method).__name__} kept different numbers of entries per layer ({sorted(kept)})")
    entries.positions, entries.seen, entries.states = new_positions, end, new_states
    return end - kept.pop()


def blocks_needed(entries: int, block_size: int) -> int:
    """Blocks that hold a request's first `entries` stored entries (what it keeps after a compaction)."""
    return -(-entries // block_size)
