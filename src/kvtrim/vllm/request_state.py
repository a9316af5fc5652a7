"""`TrimRequest`: the scheduler's state of one request under kvtrim (its method's counts, and what
`kvtrim.vllm.manager.TrimAttentionManager` did for it: admission, reservation, prefix-cache sharing, the shared
context it reads or registers). No vLLM import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtrim.methods.base import EvictionMethod
from kvtrim.vllm.contexts import SharedContext
from kvtrim.vllm.planning import Due, StoredCounts


@dataclass
class TrimRequest:
    """The scheduler's state of one request (its method's, and what this manager did for it)."""

    request: Any  #: vLLM's `Request`
    method: EvictionMethod | None  #: None: `full`
    #: the tokens its method is told as its prompt: its context (`kvtrim_context`) when it names one, else its prompt
    prompt_tokens: int = 0
    #: its stored counts, from its first forward on (again after a preemption)
    counts: StoredCounts | None = None
    #: entries discarded by the compactions that ran (what it stores = tokens computed - discarded)
    discarded: int = 0
    #: whether its peak was worked out, and the blocks it needs at most (None: its method bounds nothing)
    peak_known: bool = False
    peak: int | None = None
    #: True when its method keeps every token it decodes (a prompt-end method): no reservation for that growth
    grows: bool = False
    #: the block its method reads its prompt in (`prompt_block`; None: the prompt whole), asked once at `start`
    block: int | None = None
    #: True once it holds blocks (admitted), until it is preempted
    admitted: bool = False
    #: blocks reserved for its peak once admitted by peak (None: nothing reserved)
    reserved: int | None = None
    #: the compaction planned after the step being run
    due: Due | None = None
    #: it shares vLLM's prefix cache (module docstring); then the fresh blocks its first compaction may need
    shares: bool = False
    spares_needed: int = 0
    #: its first compaction is planned: it caches nothing more, and every block it holds is its own
    private: bool = False
    #: fresh blocks held for the copies of its first compaction, from its admission until then
    spare: list = field(default_factory=list)
    #: the shared or cached blocks the planned compaction replaced (let go once it ran)
    replaced: list = field(default_factory=list)
    #: its context's key when its method shares compressed contexts (`kvtrim.vllm.contexts`); the registered
    #: context it was found to start from (until its blocks are allocated: `hit`) and that it reads (`reads`);
    #: the context its planned compaction registers once it ran
    context_key: tuple | None = None
    hit: SharedContext | None = None
    reads: SharedContext | None = None
    registers: SharedContext | None = None

    def restart(self) -> list:
        """Preempted: recomputed later from its tokens, its counts start over. Returns the blocks it held beside
        its block table (spare, replaced, the copy of a context it was registering), for vLLM to free with it."""
        held, self.spare, self.replaced = self.spare + self.replaced, [], []
        if self.registers is not None and self.registers.tail is not None:
            held.append(self.registers.tail)
        self.counts, self.discarded, self.admitted, self.reserved, self.due = None, 0, False, None, None
        self.private, self.hit, self.reads, self.registers = False, None, None, None
        return held

    def spares_to_take(self) -> int:
        """The spare blocks it takes when admitted: for the copies of its first compaction, while it shares the
        prefix cache and that compaction is not planned yet."""
        return self.spares_needed if self.shares and not self.private else 0
