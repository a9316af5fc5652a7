"""Compressed contexts shared by many requests (`vllm_xargs: {"kvtrim_context": N}`): compress once, serve many.

A request that names a context (its first N prompt tokens) under a method that never writes its context again
once compressed (`spec.shares_context`: the prompt-end modes of the ranking methods) registers it after its
context's compaction: the scheduler's registry (`ContextRegistry`, held by `TrimAttentionManager`) keeps the
blocks of the K entries kept, keyed by the context (`context_key`: the hash vLLM's prefix cache gives its last
full block, which chains every token before it and the request's `cache_salt`, the tokens after that block,
and the method's hyper-parameters). A later request with the same key starts from it: vLLM counts its first N
tokens as computed, its block table starts with the context's full blocks (shared, read-only: it writes only
slots K and after), the context's last block when partly filled is copied into a block of its own (the
request's next tokens are written after it), and its entries start as the context's (the worker's copy of
the kept positions, `ContextEntries`): no prefill of the context, no compression.

The registry holds a reference to each of a context's blocks, so they count as used in vLLM's pool; when an
allocation lacks free blocks, the least recently used contexts that no running request reads go back first
(`make_room`), before vLLM preempts anyone. Released contexts are named to the worker with the next step's
plan, which forgets their entries.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtrim.vllm.entries import RequestEntries


@dataclass
class SharedContext:
    """One compressed context in the registry."""

    id: int  #: the worker's name for its entries
    key: tuple  #: `context_key`
    tokens: int  #: N: the tokens it compresses
    kept: int  #: K: the entries kept (its first K slots)
    #: the blocks of its first K // block_size slots (shared by its readers) and, when K does not fill its last
    #: block, a copy of that block (copied by each reader into a block of its own): a reference each
    blocks: list = field(default_factory=list)
    tail: Any = None
    counts: Any = None  #: the planner's `StoredCounts` after its compaction (each reader starts from a copy)

    #: the registry's step when a request last started from it (its last block is copied in that step's forward)
    read_at: int = -1

    def idle(self, step: int) -> bool:
        """No running request reads its blocks (the registry holds the only reference), and none starts from it in
        step `step`."""
        return self.read_at != step and all(block.ref_cnt == 1 for block in self.blocks)

    def held(self) -> list:
        return self.blocks + ([self.tail] if self.tail is not None else [])


def context_key(request, method, tokens: int, block_size: int) -> tuple:
    """The key of request `request`'s context of `tokens` tokens under `method`: vLLM's hash of its last full
    block (chained over every token before it, with the request's salt and LoRA), the tokens after that block,
    and the method (its dataclass repr: every hyper-parameter)."""
    full = tokens // block_size
    last = request.block_hashes[full - 1] if full else None
    lora = getattr(request.lora_request, "lora_int_id", None)
    return (tokens, last, tuple(request.prompt_token_ids[full * block_size:tokens]), request.cache_salt, lora,
            repr(method))


class ContextRegistry:
    """The scheduler's compressed contexts, least recently used first (module docstring)."""

    def __init__(self, block_pool):
        self.block_pool = block_pool
        self.contexts: OrderedDict[tuple, SharedContext] = OrderedDict()
        #: contexts whose compaction is planned, not run yet (key -> context): one registration per key
        self.pending: dict[tuple, SharedContext] = {}
        #: ids of the contexts released since the last step's plan (the worker forgets their entries)
        self.released: list[int] = []
        self._next_id = 0
        #: counts the scheduler's steps (`take_released` ends one)
        self.step = 0

    def find(self, key: tuple) -> SharedContext | None:
        """The context of `key` (now the most recently used), or None."""
        found = self.contexts.get(key)
        if found is not None:
            self.contexts.move_to_end(key)
        return found

    def read(self, context: SharedContext) -> None:
        """A request starts from `context` in this step: it is not released before the step's forward."""
        context.read_at = self.step

    def known(self, key: tuple) -> bool:
        """Whether the context of `key` is registered, or a request's planned compaction registers it."""
        return key in self.contexts or key in self.pending

    def pending_context(self, key: tuple, tokens: int, kept: int, tail: Any, counts: Any) -> SharedContext:
        """The context of `key` that a request's planned compaction registers (its key not `known`): added once
        the compaction ran (`add`), else `abandon`ed."""
        self._next_id += 1
        context = self.pending[key] = SharedContext(self._next_id, key, tokens, kept, tail=tail, counts=counts)
        return context

    def add(self, context: SharedContext) -> None:
        """Register `context` (pending), whose blocks the caller gave it a reference to."""
        self.pending.pop(context.key, None)
        self.contexts[context.key] = context

    def abandon(self, context: SharedContext) -> None:
        """A pending context is not registered (its request was aborted, preempted or failed before its compaction
        was counted): its key is free again, and the worker, which may have kept its entries, forgets them with
        the next step's plan. (Its tail block goes back with its request's blocks.)"""
        if self.pending.get(context.key) is context:
            del self.pending[context.key]
        self.released.append(context.id)

    def make_room(self, needed: int, partly: bool = True) -> None:
        """Release idle contexts, least recently used first, until the pool has `needed` free blocks (or none
        is idle); with `partly` False, none unless that makes them free."""
        idle = [key for key, context in self.contexts.items() if context.idle(self.step)]
        if not partly:
            free = self.block_pool.get_num_free_blocks()
            if free + sum(len(self.contexts[key].held()) for key in idle) < needed:
                return
        for key in idle:
            if self.block_pool.get_num_free_blocks() >= needed:
                return
            self._release(self.contexts.pop(key))

    def clear(self) -> None:
        for key in list(self.contexts):
            self._release(self.contexts.pop(key))

    def take_released(self) -> list[int]:
        """The contexts released in this step (for its plan); the next step starts."""
        released, self.released = self.released, []
        self.step += 1
        return released

    def held_blocks(self) -> int:
        return sum(len(c.held()) for c in self.contexts.values())

    def describe(self) -> str:
        """What it holds, for the logs (the tests read the count of blocks there)."""
        return f"{len(self.contexts)} shared contexts hold {self.held_blocks()} blocks"

    def _release(self, context: SharedContext) -> None:
        self.block_pool.free_blocks(context.held())
        self.released.append(context.id)


@dataclass
class ContextEntries:
    """The worker's copy of a shared context's entries after its compaction (what each reader starts from)."""

    positions: list[torch.Tensor]
    seen: int
    states: list[Any] | None

    @classmethod
    def of(cls, entries: RequestEntries) -> ContextEntries:
        return cls(list(entries.positions), entries.seen, copy.deepcopy(entries.states))

    def entries(self) -> RequestEntries:
        """A reader's own entries, starting as the context's (the tensors are never written in place: shared)."""
        return RequestEntries(positions=list(self.positions), seen=self.seen, states=copy.deepcopy(self.states))
