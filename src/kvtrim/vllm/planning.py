"""What a request's forwards are to its method, and how many entries the request stores after each.

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

`StoredCounts` (the scheduler: the one authority for counts) follows a request through its forwards: the
method's own `target` on the counts when its schedule alone decides them (KeyDiff, StreamingLLM, KNorm, and
SnapKV, TOVA, H2O, whose attention picks only which entries: no tensors, 7-21 µs a step; LazyEviction by
its decode steps, `kept_after_decode`), else the method run on stand-in keys (one layer, one KV head,
head_dim 8): how many entries the request stores after each forward, and which forwards change anything
(`due`). The methods the engine runs keep counts that depend on token counts only (`kvtrim.vllm.spec`), so the
scheduler's manager (`kvtrim.vllm.manager.TrimAttentionManager`) frees blocks by these counts and tells the
worker, with each step's `SchedulerOutput` (`PLAN_ATTR`), which requests to compact and the count each must
reach (`plan_forward`); the worker applies the method (`kvtrim.vllm.compact`) and checks its real count against
it (a disagreement ends that request only).

Forwards that are not due are not shown to the real method (reading a request's whole cache at every
decode step would cost more than the step). That is exact for methods whose hooks, on a forward that
evicts nothing, leave their state as it was: the stand-in marks a forward due when it evicts or when
its state changes (a state that cannot be compared, e.g. tensors, makes every forward due).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import EvictionMethod, Phase, ScoringMethod, check
from kvtrim.vllm.decide import hand_over

#: the attribute of a step's `ModelRunnerOutput` where the worker hands the scheduler the requests whose
#: compaction failed (req_id -> why, one line): the scheduler ends them with an error
FAILED_ATTR = "kvtrim_failed"

#: the attribute of a step's `SchedulerOutput` where the scheduler hands the worker its `StepPlan`
PLAN_ATTR = "kvtrim_plan"

class Step(NamedTuple):
    """One step of a forward as the method sees it (`forward_steps`)."""

    phase: Phase
    ends_prompt: bool
    tokens: int


@dataclass(frozen=True)
class Due:
    """A forward after which a request is compacted: its `steps` (`forward_steps`), the request's token
    count `end` after it, and the entries it must have `discarded` by then (the scheduler's count). `copies`:
    `(index, old block id, new block id)` of the blocks of its block table that its manager replaced by fresh
    ones before this compaction writes them (the old one shared or in the prefix cache): the worker copies each
    old block into the new one after the forward, then compacts. `registers`: the compaction ends a context that
    requests will share (`kvtrim.vllm.contexts`): the id its entries are kept under, and the block the worker copies
    the context's last, partly filled block into (None when its kept entries fill their blocks)."""

    steps: list[Step]
    end: int
    discarded: int
    copies: tuple[tuple[int, int, int], ...] = ()
    registers: tuple[int, int | None] | None = None


@dataclass(frozen=True)
class StepPlan:
    """What the scheduler planned for one step: the requests the worker compacts after its forward
    (req_id -> `Due`) and the seconds the planning took (the worker counts them as eviction time). Shared
    contexts (`kvtrim.vllm.contexts`): the requests that start from one in this step (req_id -> its id and the
    entries the request has discarded: the context's tokens less its kept entries), the
    blocks to copy before the forward (`(from, to)` block ids: a context's last block into a reader's own), and
    the contexts released (the worker forgets their entries)."""

    due: dict[str, Due]
    seconds: float
    adopted: dict[str, tuple[int, int]] = field(default_factory=dict)
    copies: tuple[tuple[int, int], ...] = ()
    released: tuple[int, ...] = ()


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
            steps.append(Step(Phase.PREFILL, True, prompt_tokens))
        else:
            stop = block_end(computed, prompt_tokens, block)
            check(end <= stop, f"a forward of tokens {computed}..{end - 1} crosses the end of its prompt block at {stop}")
            if end < stop:
                return []
            steps.append(Step(Phase.PREFILL, stop == prompt_tokens, stop - (stop - 1) // block * block))
        start = min(end, prompt_tokens)
    if end > start:
        steps.append(Step(Phase.APPEND if end - start > 1 else Phase.DECODE, False, end - start))
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
    seen (`stored_after`: LagKV's reference mode) by it, one whose count follows its decode steps
    (`counts_by_decode_steps`: LazyEviction) by `kept_after_decode`; any other runs on the stand-in keys (a
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
        #: counted by `kept_after_decode` (LazyEviction): its decode steps since the last prompt block or append
        self.by_decode = not (self.by_count or self.by_length) and method.counts_by_decode_steps
        self.seen = self.stored = self.decode_steps = 0
        self.prompt_tokens: int | None = None
        self.cache = TrimCache(method, in_place_decode=False)
        self._gen = torch.Generator().manual_seed(0)

    @property
    def _layer(self) -> TrimLayer | None:
        return self.cache.layers[0] if self.cache.layers else None

    @property
    def discarded(self) -> int:
        """Entries discarded so far (tokens seen minus entries stored)."""
        if self.by_count or self.by_length or self.by_decode:
            return self.seen - self.stored
        layer = self._layer
        return 0 if layer is None else layer.seen - layer.stored

    @property
    def held(self) -> int:
        """Entries stored now (of the tokens told so far)."""
        if self.by_count or self.by_length or self.by_decode:
            return self.stored
        layer = self._layer
        return 0 if layer is None else layer.stored

    def advance(self, steps: list[Step]) -> bool:
        """Tell the counts a forward's `steps`; True when the forward is due (it evicts, or changes the
        method's state): the worker must run the method on it."""
        if self.by_length:
            return self._by_length(steps)
        if self.by_decode:
            return self._by_decode(steps)
        return self._count(steps) if self.by_count else self._stand_in(steps)

    def _by_length(self, steps: list[Step]) -> bool:
        tokens = sum(step.tokens for step in steps)
        self.seen += tokens
        stored, self.stored = self.stored + tokens, self.method.stored_after(self.seen)
        return self.stored < stored

    def _by_decode(self, steps: list[Step]) -> bool:
        due = False
        for step in steps:
            self.seen += step.tokens
            self.stored += step.tokens
            if step.phase is not Phase.DECODE:  # a prompt block or an append: evicts nothing, restarts the count
                due = due or self.decode_steps > 0  # (and the method's tracking: a state to drop, if it tracked)
                self.decode_steps = 0
                continue
            self.decode_steps += 1
            due = True  # its state follows every decode step
            n_keep = self.method.kept_after_decode(self.stored, self.decode_steps)
            if n_keep is not None and self.stored > n_keep:
                self.stored = n_keep
        return due

    def _count(self, steps: list[Step]) -> bool:
        due = self.stateful and bool(steps)
        for step in steps:
            self.seen += step.tokens
            self.stored += step.tokens
            if step.ends_prompt:
                self.prompt_tokens = self.seen
            n_keep = self.method.target(_Counts(step.phase, step.ends_prompt, self.prompt_tokens, self.stored))
            if n_keep is not None and self.stored > n_keep:
                self.stored, due = n_keep, True
        return due

    def _stand_in(self, steps: list[Step]) -> bool:
        due = False
        for step in steps:
            q = step.tokens
            layer = self._layer
            evictions = 0 if layer is None else layer.evictions
            state = self.cache.method.new_state(0) if layer is None else layer.state
            # a state that cannot be compared counts as changed (`_changed`): no copy to compare it with
            state = _UNCOMPARABLE if not _comparable(state) else copy.deepcopy(state)
            k, v = torch.randn(2, 1, 1, q, 8, generator=self._gen)
            with self.cache.phase(step.phase, ends_prompt=step.ends_prompt):
                full = self.cache.update(k, v, 0)
            layer = self._layer
            if layer.awaiting_attention:  # stand-in queries, handed over as the worker's compaction hands them
                queries = torch.randn(1, 1, q, 8, generator=self._gen) if self.method.needs_attention else None
                prompt = self._queries(q) if step.phase is Phase.PREFILL else None
                hand_over(layer, step.phase, q, full, prompt, queries, 8 ** -0.5)
            due = due or layer.evictions != evictions or _changed(state, layer.state)
        return due

    def _queries(self, q: int) -> torch.Tensor:
        """Stand-in queries `(1, 1, W, 8)` of a prompt block's step of `q` tokens: its last `prompt_queries()`
        positions (what the worker hands over, `kvtrim_prompt_queries`)."""
        return torch.randn(1, 1, min(q, self.method.prompt_queries() or q), 8, generator=self._gen)


def plan_forward(counts: StoredCounts | None, method: EvictionMethod, computed: int, end: int,
                 prompt_tokens: int) -> tuple[StoredCounts | None, Due | None]:
    """Tell a request's `counts` (None before its first forward) a forward computing its tokens `computed`..`end - 1`.
    Returns its counts afterwards (new at its first forward; a request that starts over, `computed == 0`, starts
    afresh) and the `Due` compaction after the forward, or None when the method does nothing there."""
    if computed == 0:
        counts = None
    steps = forward_steps(computed, end, prompt_tokens, prompt_block(method))
    if not steps:
        return counts, None
    if counts is None:
        counts = StoredCounts(method)
    return counts, (Due(steps, end, counts.discarded) if counts.advance(steps) else None)


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


def request_total(prompt_tokens: int, max_tokens: int, max_len: int | None) -> int:
    """The most tokens a request may reach: its prompt and `max_tokens`, at most `max_len` (`--max-model-len`)."""
    total = prompt_tokens + max_tokens
    return total if max_len is None else min(total, max_len)


def request_peak(method: EvictionMethod | None, prompt_tokens: int, total: int,
                 block_size: int) -> tuple[int | None, bool]:
    """The blocks a request of `prompt_tokens` that may reach `total` tokens holds at most under `method`: once
    its prompt is in and then as it decodes (`EvictionMethod.peak_stored`), and while its prompt is read when it
    is read in blocks (`prompt_peak`); None when its method does not bound it below its tokens. And whether its
    method keeps every token it decodes (its peak reached only at its last token: a prompt-end method)."""
    if method is None:
        return None, False
    peak = method.peak_stored(prompt_tokens, total)
    if peak is None or peak >= total:
        return None, False
    grows = total > prompt_tokens and peak == method.peak_stored(prompt_tokens, prompt_tokens) + total - prompt_tokens
    if prompt_block(method) is not None:
        peak = max(peak, prompt_peak(method, prompt_tokens))
    return blocks_needed(peak, block_size), grows


def never_fits(method: EvictionMethod | None, prompt_tokens: int, max_tokens: int, total: int, peak: int | None,
               block_size: int, pool: int) -> str | None:
    """Why a request can never run in a pool of `pool` usable blocks (one line), or None: the most it may hold
    (`peak`, from `request_peak`; its `total` tokens when its method does not bound it) exceeds the pool. The
    one rule of the scheduler's manager (which ends such a request before it runs) and of the server's front
    end (which answers it with a 400: `kvtrim.vllm.platform`)."""
    blocks = blocks_needed(total, block_size) if peak is None else peak
    if blocks <= pool:
        return None
    name = "full" if method is None else type(method).__name__
    return (f"its prompt of {prompt_tokens} tokens and max_tokens={max_tokens} may take {blocks} KV blocks under "
            f"{name}, more than the {pool} of this server's pool: send a shorter request, or a method that bounds "
            f"it (e.g. keydiff:budget=...)")


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



def leaves_hole(steps: list[Step]) -> bool:
    """A compaction after a forward that ends in a decode step may leave a hole (the next forward's first token
    fills it); it then keeps one slot more than it stores (`slots_held`)."""
    return steps[-1].phase is Phase.DECODE


def slots_held(due: Due) -> int:
    """The slots a request keeps after its compaction at `due` (the scheduler keeps their blocks, the worker its
    block ids): what it stores, plus one after a decode step: the next token's slot (the hole the compaction
    left, or the one after the stored entries), whose block the next step would otherwise take back at once."""
    return due.end - due.discarded + leaves_hole(due.steps)


def blocks_needed(entries: int, block_size: int) -> int:
    """Blocks that hold a request's first `entries` stored entries (or slots)."""
    return -(-entries // block_size)
