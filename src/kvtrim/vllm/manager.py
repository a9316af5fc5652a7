"""`TrimAttentionManager`: the one owner of a kvtrim request's blocks and counts in vLLM's scheduler.

vLLM builds one single-type manager per kind of KV memory (`FullAttentionManager`, `SlidingWindowManager`, ...),
chosen through its `KVCacheSpecRegistry` by the layers' `KVCacheSpec`. kvtrim's worker reports
`TrimAttentionSpec` (`kvtrim.vllm.kv_spec`), registered here with this manager: vLLM's coordinator then builds a
`TrimAttentionManager` for the model's full-attention layers, as it builds its sliding-window manager for
sliding-window layers. It is vLLM's `FullAttentionManager`, plus:

* one `TrimRequest` per request (`start`, from the scheduler's `add_request`): its method, its stored counts
  (`StoredCounts`), the entries it has discarded, its peak and what it reserved;
* the plan: each forward vLLM scheduled for a request is told to its counts (`plan`), which say whether the
  worker compacts it after the forward and the count it reaches (`Due`); the scheduler hands the step's plans to
  the worker, which applies them and does not count (a disagreement found by the method ends that request);
* the blocks: a request is sized by what it stores (tokens minus entries discarded) in
  `get_num_blocks_to_allocate` and `allocate_new_blocks`, and once a compaction ran (`compacted`) its tail blocks
  past the slots it keeps go back to the pool, from this manager's own lists;
* admission (`--admission peak`, the default): a request whose method bounds what it stores while it decodes
  (`EvictionMethod.peak_stored`: budget modes, LagKV's reference mode; while its prompt is read in blocks,
  `prompt_peak`) is admitted only when the free pool, less what admitted requests may still take to reach their
  peaks (`_debt`), holds its peak, and reserves it: it is never preempted for want of blocks by a request
  admitted after it. A request whose method keeps every token after its prompt (a prompt-end method: its peak is
  its kept prompt plus all its `max_tokens`) reserves nothing for that growth: it is admitted as vLLM admits (its
  prompt must fit), beside the reserved blocks, since reserving every request's whole `max_tokens` holds fewer
  requests at once than the pool can run (`grows`); one its method could never fit in the pool is refused
  (`fail`), never admitted to be preempted forever;
* the life of a request: started, planned, compacted, preempted (vLLM frees its blocks while it is not finished:
  its counts start over and it is recomputed later), finished or aborted (its state goes): `_release`, the one
  cleanup path, runs from vLLM's own `free` / `pop_blocks_for_free`;
* failures: whatever a method raises while this manager plans or admits its request ends that request only:
  the request is named in `failed` (one line), never admitted again, and the scheduler ends it with an error;
* prefix caching (vLLM's, on by default): `full` requests share cached blocks as in vLLM; a request whose method
  compacts neither finds cached blocks nor caches its own (`start`, `cache_blocks`): a compaction never writes
  a block another request holds or the cache indexes, and no block computed after an eviction is found under
  its tokens' hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtrim.methods.base import EvictionMethod, one_line
from kvtrim.vllm.planning import (Due, StoredCounts, blocks_needed, never_fits, plan_forward, prompt_block,
                                  request_peak, slots_held)
from kvtrim.vllm.worker_check import check_vllm_version

check_vllm_version()

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402

#: blocks asked for a request that must not be admitted (failed, or never fits): more than any pool holds
_NEVER = 1 << 40


@dataclass
class TrimRequest:
    """The scheduler's state of one request (its method's, and what this manager did for it)."""

    request: Any  #: vLLM's `Request`
    method: EvictionMethod | None  #: None: `full`
    #: its stored counts, from its first forward on (again after a preemption)
    counts: StoredCounts | None = None
    #: entries discarded by the compactions that ran (what it stores = tokens computed - discarded)
    discarded: int = 0
    #: whether its peak was worked out, and the blocks it needs at most (None: its method bounds nothing)
    peak_known: bool = False
    peak: int | None = None
    #: True when its method keeps every token it decodes (a prompt-end method): no reservation for that growth
    grows: bool = False
    #: True once it holds blocks (admitted), until it is preempted
    admitted: bool = False
    #: blocks reserved for its peak once admitted by peak (None: nothing reserved)
    reserved: int | None = None
    #: the compaction planned after the step being run
    due: Due | None = None

    def restart(self) -> None:
        """Preempted: recomputed later from its tokens, its counts start over."""
        self.counts, self.discarded, self.admitted, self.reserved, self.due = None, 0, False, None, None


class TrimAttentionManager(FullAttentionManager):
    """vLLM's full-attention manager that owns kvtrim's per-request counts (module docstring)."""

    def __init__(self, kv_cache_spec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.states: dict[str, TrimRequest] = {}
        #: req_id -> why (one line): requests to end with an error at the step's update (planning or admission
        #: failed, or the pool can never hold them); the scheduler takes them (`take_failed`)
        self.failed: dict[str, str] = {}
        #: "peak" or "vllm" (`kvtrim serve --admission`) and the longest request, set by the scheduler (`configure`)
        self.admission = "peak"
        self.max_model_len: int | None = None
        #: blocks returned to the pool by compactions so far (logs, tests)
        self.freed_blocks = 0

    def configure(self, admission: str, max_model_len: int) -> None:
        self.admission, self.max_model_len = admission, max_model_len

    # -- the life of a request ------------------------------------------------------------------------------

    def start(self, request, method: EvictionMethod | None) -> None:
        """A new request, under `method` (None: `full`). One whose method compacts keeps out of the prefix cache:
        it finds no cached blocks (vLLM's per-request `skip_reading_prefix_cache`, as for a request that wants its
        prompt's logprobs) and caches none of its own (`cache_blocks`), so every block it compacts is its own."""
        self.states[request.request_id] = TrimRequest(request, method)
        if method is not None:
            request.skip_reading_prefix_cache = True

    def cache_blocks(self, request, num_tokens, *args, **kwargs) -> None:
        # vLLM indexes a request's full blocks by the hash of their tokens as they are scheduled; a compacting
        # request's blocks stop holding those tokens in order (and later ones are computed after an eviction)
        state = self.states.get(request.request_id)
        if state is not None and state.method is not None:
            return
        super().cache_blocks(request, num_tokens, *args, **kwargs)

    def fail(self, request_id: str, why: str) -> None:
        """End request `request_id` with an error at the step's update (`take_failed`); it is not admitted again."""
        self.failed.setdefault(request_id, why)

    def take_failed(self) -> dict[str, str]:
        failed, self.failed = self.failed, {}
        return failed

    def plan(self, request_id: str, computed: int, end: int) -> Due | None:
        """The compaction after the forward that computes request `request_id`'s tokens `computed`..`end - 1`
        (None: its method does nothing there). A request that starts over (`computed == 0`) starts afresh."""
        state = self.states.get(request_id)
        if state is None or state.method is None or request_id in self.failed:
            return None
        state.counts, state.due = plan_forward(state.counts, state.method, computed, end,
                                               state.request.num_prompt_tokens)
        return state.due

    def compacted(self, request_id: str) -> int:
        """The step's planned compaction of request `request_id` ran: it has discarded the plan's count and
        keeps `slots_held` slots; its blocks past them go back to the pool. Returns the blocks freed."""
        state = self.states.get(request_id)
        due = None if state is None else state.due
        if due is None:
            return 0
        state.due, state.discarded = None, due.discarded
        blocks = self.req_to_blocks.get(request_id)
        keep = blocks_needed(slots_held(due), self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))  # tail first, as vLLM frees
        self.freed_blocks += len(tail)
        return len(tail)

    def pop_blocks_for_free(self, request_id: str):
        # vLLM's `free` comes here too: the one place a request's state ends (finished, aborted) or starts over
        self._release(request_id)
        return super().pop_blocks_for_free(request_id)

    def _release(self, request_id: str) -> None:
        state = self.states.get(request_id)
        if state is None:
            return
        if state.request.is_finished():
            del self.states[request_id]
            self.failed.pop(request_id, None)
        else:  # preempted: vLLM recomputes it from its tokens
            state.restart()

    # -- blocks ---------------------------------------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, apply_admission_cap=False, **kwargs):
        state = self.states.get(request_id)
        if state is None:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, *args,
                                                      apply_admission_cap=apply_admission_cap, **kwargs)
        if state.admitted:  # a running request: sized by what it stores
            return super().get_num_blocks_to_allocate(request_id, num_tokens - state.discarded, *args, **kwargs)
        if request_id in self.failed:
            return _NEVER
        try:
            peak = self._peak(state)
            why = self._unfit(state, peak)
            if why is not None:  # admitted, it would take the pool and be preempted, again and again
                self.fail(request_id, why)
                return _NEVER
            if apply_admission_cap:  # vLLM's full-sequence gate
                if prompt_block(state.method) is not None:  # it never holds its whole prompt: its peak admits it
                    return 0
                return super().get_num_blocks_to_allocate(request_id, num_tokens, *args, apply_admission_cap=True,
                                                          **kwargs)
            blocks = super().get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs)
            if self.admission != "peak":
                return blocks
            # the free pool must hold what admitted requests may still take, and this one's peak if it reserves it
            return max(blocks, 0 if peak is None or state.grows else peak) + self._debt()
        except Exception as err:  # noqa: BLE001 - one request's method must not stop the engine
            self.fail(request_id, f"admission: {one_line(err)}")
            return _NEVER

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        state = self.states.get(request_id)
        if state is None:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        if not state.admitted:
            state.admitted = True
            state.reserved = state.peak if self.admission == "peak" and not state.grows else None
        gone = state.discarded
        return super().allocate_new_blocks(request_id, num_tokens - gone, num_tokens_main_model - gone)

    def _debt(self) -> int:
        """Blocks that admitted requests may still take to reach their peaks."""
        return sum(max(0, s.reserved - len(self.req_to_blocks.get(rid, ())))
                   for rid, s in self.states.items() if s.reserved is not None)

    def _total(self, state: TrimRequest) -> int:
        request = state.request
        total = request.num_prompt_tokens + request.max_tokens
        return total if self.max_model_len is None else min(total, self.max_model_len)

    def _peak(self, state: TrimRequest) -> int | None:
        """The blocks the request holds at most (`request_peak`; None: its method does not bound it), worked out
        once."""
        if not state.peak_known:
            state.peak, state.grows = request_peak(state.method, state.request.num_prompt_tokens, self._total(state),
                                                   self.block_size)
            state.peak_known = True
        return state.peak

    def _unfit(self, state: TrimRequest, peak: int | None) -> str | None:
        """Why the request can never run in this pool (`never_fits`), or None."""
        request = state.request
        return never_fits(state.method, request.num_prompt_tokens, request.max_tokens, self._total(state), peak,
                          self.block_size, self.block_pool.num_gpu_blocks - 1)  # vLLM keeps one null block
