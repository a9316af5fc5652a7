"""What the worker knows of a request between compactions: which token each slot holds (`RequestEntries`), and
the rest of its state (`WorkerRequest`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrim.methods.base import EvictionMethod, check


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
    #: the request's decision layer kept between decode steps (`kvtrim.vllm.compact`): a positions-only method's
    #: after a step that left a hole (`TrimCache` of one layer on stand-in keys in slot order, its free slot the
    #: hole), or an attention-fed method's (`kvtrim.vllm.live`); the next decode step runs on it instead of on a layer
    #: resumed from the positions; any other compaction drops it
    live: Any = None

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
        self.positions = per_tensor(self.positions, lambda p: p.index_fill(-1, torch.tensor([hole]), position))
        return hole

    def slots(self, layer: int) -> torch.Tensor:
        """The positions `(kv_heads, m)` of the tokens in layer `layer`'s first `m` slots, -1 at the hole."""
        assert self.positions is not None
        if self.hole is None:
            return self.positions[layer]
        return self.positions[layer].index_fill(-1, torch.tensor([self.hole]), -1)


def per_tensor(tensors: list[torch.Tensor], f) -> list[torch.Tensor]:
    """`f` applied once per distinct tensor of `tensors` (layers that share one positions tensor share the
    result too; all of them at once when they are one tensor, the common case)."""
    if all(t is tensors[0] for t in tensors):
        return [f(tensors[0])] * len(tensors)
    done: dict[int, torch.Tensor] = {}
    for t in tensors:
        if id(t) not in done:
            done[id(t)] = f(t)
    return [done[id(t)] for t in tensors]


@dataclass
class WorkerRequest:
    """The worker's state of one request, from its first forward (again after a preemption: it is recomputed)
    until it finishes or is aborted (`TrimModelRunner._kvtrim_forget`, the one cleanup path; the attention
    hand-off's copies of its queries go with it)."""

    #: its method (None: `full`)
    method: EvictionMethod | None
    #: the tokens its method is told as its prompt: its context (`kvtrim_context`) when it names one, else its prompt
    prompt_tokens: int = 0
    #: what its stored entries are (positions per slot, the method's per-layer state)
    entries: RequestEntries = field(default_factory=RequestEntries)
    #: entries discarded by compaction (what it stores = its tokens - discarded), as the scheduler's plans say
    discarded: int = 0
    #: per layer, the column sums `(kv_heads, prompt)` float32 of its prompt's causal attention so far (a method
    #: given them, `prompt_sums`: H2O), added after each prefill chunk's forward
    prompt_sums: list[torch.Tensor] | None = None
    #: its compactions after its prompt so far (one log line when it ends, not one per compaction)
    later_compactions: int = 0
