"""`TrimAttentionManager`: the one owner of a kvtrim request's blocks and counts in vLLM's scheduler.

vLLM builds one single-type manager per kind of KV memory (`FullAttentionManager`, `SlidingWindowManager`, ...),
chosen through its `KVCacheSpecRegistry` by the layers' `KVCacheSpec`. kvtrim's worker reports
`TrimAttentionSpec` (`kvtrim.vllm.kv_spec`), registered here with this manager: vLLM's coordinator then builds a
`TrimAttentionManager` for the model's full-attention layers, as it builds its sliding-window manager for
sliding-window layers. It is vLLM's `FullAttentionManager`, plus:

* one `TrimRequest` per request (`kvtrim.vllm.request_state`; `start`, from the scheduler's `add_request`): its
  method, its stored counts (`StoredCounts`), the entries it has discarded, its peak and what it reserved;
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
* prefix caching (vLLM's, on by default): `full` requests share cached blocks as in vLLM. A request whose method
  compacts nothing before its prompt ends (`spec.reads_prefix_cache`) shares them too (`TrimRequest.shares`): it
  starts from the cached blocks of its prompt and caches its own blocks until its first compaction is planned
  (`private`; blocks computed after an eviction are never cached). That compaction writes the request's first
  blocks: each of them that another request holds or the cache indexes is replaced by a fresh block (taken from
  the `spare` blocks reserved when it was admitted) which the worker fills with the old one's contents before it
  compacts (`Due.copies`, copy on write); the old blocks are let go once the compaction ran (`compacted`), and
  stay in the cache. A preempted request stops sharing (it is recomputed without the cache). A request with a context (`kvtrim_context`) shares it too, its hits kept inside the context
  (its block hashes past the context's last full block are dropped until vLLM extends them after its prompt), so
  that the context's compaction runs: a document is computed once for all its questions, and compressed for
  each. Any other compacting request keeps out of the cache (it finds and caches nothing), as does one whose
  prompt and spare blocks would not fit the pool.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from kvtrim.methods.base import EvictionMethod, KvtrimError, one_line
from kvtrim.vllm.planning import (Due, blocks_needed, never_fits, plan_forward, prompt_block,
                                  request_peak, request_total, slots_held)
from kvtrim.vllm.contexts import ContextRegistry, SharedContext, context_key
from kvtrim.vllm.request_state import TrimRequest
from kvtrim.vllm.spec import reads_prefix_cache, request_context, request_refusal, shares_context
from kvtrim.vllm.worker_check import check_vllm_version

check_vllm_version()

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402

logger = init_logger("vllm.kvtrim")

#: blocks asked for a request that must not be admitted (failed, or never fits): more than any pool holds
_NEVER = 1 << 40


class TrimAttentionManager(FullAttentionManager):
    """vLLM's full-attention manager that owns kvtrim's per-request counts (module docstring)."""

    def __init__(self, kv_cache_spec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.states: dict[str, TrimRequest] = {}
        #: req_id -> why (one line): requests to end with an error at the step's update (planning or admission
        #: failed, or the pool can never hold them); the scheduler takes them (`take_failed`)
        self.failed: dict[str, str] = {}
        #: "peak" or "vllm" (`kvtrim serve --admission`), the longest request and the tensor-parallel ranks, set by
        #: the scheduler (`configure`)
        self.admission = "peak"
        self.max_model_len: int | None = None
        self.tensor_parallel = 1
        #: blocks returned to the pool by compactions so far (logs, tests)
        self.freed_blocks = 0
        #: compressed contexts shared by requests (`kvtrim.vllm.contexts`), and what this step tells the worker of
        #: them: requests starting from one (req_id -> (context id, entries discarded)), blocks to copy
        self.contexts = ContextRegistry(self.block_pool)
        self._adopted: dict[str, tuple[int, int]] = {}
        self._copies: list[tuple[int, int]] = []

    def configure(self, admission: str, max_model_len: int, tensor_parallel: int = 1) -> None:
        self.admission, self.max_model_len, self.tensor_parallel = admission, max_model_len, tensor_parallel

    # -- the life of a request ------------------------------------------------------------------------------

    def start(self, request, method: EvictionMethod | None) -> None:
        """A new request, under `method` (None: `full`). Everything this manager asks its method (whether it shares
        its context or the prefix cache, its context's key, its prompt block, its peak and whether the pool can
        ever hold it) is asked here, once: whatever the method raises ends this request alone (`fail`), before
        vLLM's admission loop sees it (`TrimScheduler.schedule` ends it first). A compacting request that does not
        share the prefix cache (module docstring) finds no cached blocks (vLLM's per-request
        `skip_reading_prefix_cache`, as for a request that wants its prompt's logprobs) and caches none of its own
        (`cache_blocks`)."""
        state = self.states[request.request_id] = TrimRequest(request, method, request.num_prompt_tokens)
        try:
            self._start(request, state)
        except Exception as err:  # noqa: BLE001 - one request's method must not stop the engine
            self.fail(request.request_id, one_line(err))
        if method is not None and not state.shares:
            request.skip_reading_prefix_cache = True

    def _start(self, request, state: TrimRequest) -> None:
        method = state.method
        context = request_context(request.sampling_params)
        why = request_refusal(method, context, request.num_prompt_tokens, self.tensor_parallel)
        if why is not None:
            self.fail(request.request_id, why)
            return
        if context is not None:
            state.prompt_tokens = context
            if self.enable_caching and shares_context(method):
                state.context_key = context_key(request, method, context, self.block_size)
        state.block = prompt_block(method)
        why = self._unfit(state, self._peak(state))
        if why is not None:  # admitted, it would take the pool and be preempted, again and again
            self.fail(request.request_id, why)
            return
        if method is not None and self.enable_caching and reads_prefix_cache(method):
            spares = self._spares_needed(state)
            pool = self.block_pool.num_gpu_blocks - 1
            if spares is not None and blocks_needed(request.num_prompt_tokens, self.block_size) + spares <= pool:
                state.shares, state.spares_needed = True, spares
                if context is not None:  # a cached hit must end inside its context: the compaction at its end runs
                    del request.block_hashes[(context - 1) // self.block_size:]

    def _spares_needed(self, state: TrimRequest) -> int | None:
        """The fresh blocks a sharing request's first compaction may write: those of the most slots it keeps
        after any compaction (after its prompt for a prompt-end method), or None when its method bounds nothing;
        0 when none is ever planned (it never evicts, and its method has no state whose change is a compaction:
        LazyEviction's is planned at every decode step, evicting or not)."""
        method, prompt = state.method, state.prompt_tokens
        total = self._total(state)
        self._peak(state)  # (whether it grows)
        kept = method.peak_stored(prompt, prompt if state.grows else total)
        if kept is None:
            return None
        if kept >= total and method.new_state(0) is None and not method.counts_by_decode_steps:
            return 0
        if method.peak_stored(prompt, prompt) >= prompt:  # nothing goes where its prompt ends: its first compaction
            # comes later, maybe after the rest of its prompt (a context's question) was appended whole
            kept = max(kept, state.request.num_prompt_tokens + 1)
        return blocks_needed(min(kept, total) + 1, self.block_size)  # (+1: a decode step's hole)

    def cache_blocks(self, request, num_tokens, *args, **kwargs) -> None:
        # vLLM indexes a request's full blocks by the hash of their tokens as they are scheduled: a compacting
        # request's only until its first compaction (its blocks stop holding those tokens in order, and later
        # ones are computed after an eviction)
        state = self.states.get(request.request_id)
        if state is not None and state.method is not None:
            if state.private or not state.shares:
                return
            num_tokens = min(num_tokens, len(request.block_hashes) * self.block_size)  # (a context's: see `start`)
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
        state.counts, state.due = plan_forward(state.counts, state.method, computed, end, state.prompt_tokens)
        if state.due is not None and state.reads is not None:  # (`shares_context` promises none: a guard)
            raise KvtrimError("a compaction was planned for a request reading a shared context, whose blocks no "
                              "request may write")
        if state.due is not None and state.shares and not state.private:
            state.private = True  # its first compaction
            state.due = self._copy_on_write(request_id, state, state.due)
        if state.due is not None and state.context_key is not None and state.due.steps[0].ends_prompt:
            state.due = self._register(state, state.due)
        return state.due

    def _register(self, state: TrimRequest, due: Due) -> Due:
        """The compaction at `due` ends the request's context: it is registered once the compaction ran
        (`compacted`), with a copy of its last block when its kept entries fill it only in part (taken now; without
        a free block it is not registered). Not when its key is registered or another request registers it (many
        questions about one document at once: one registers, the others compress their own copy), nor when the
        forward went past the context (a writer recomputed after preemption, its generated tokens in the same
        forward: its entries hold them)."""
        if due.end != state.prompt_tokens or self.contexts.known(state.context_key):
            return due
        kept = due.end - due.discarded
        counts = copy.deepcopy(state.counts)
        tail = None
        if kept % self.block_size:
            if self.block_pool.get_num_free_blocks() == 0:
                return due
            tail = self.block_pool.get_new_blocks(1)[0]
        state.registers = self.contexts.pending_context(state.context_key, state.prompt_tokens, kept, tail, counts)
        return replace(due, registers=(state.registers.id, None if tail is None else tail.block_id))

    def context_hit(self, request) -> SharedContext | None:
        """The registered compressed context a waiting request starts from (vLLM's prefix-cache lookup), or None:
        its context and method match one, it does not ask for its prompt's logprobs (vLLM's own reason to skip
        the cache), and a token is left to compute after it."""
        state = self.states.get(request.request_id)
        if state is None or state.context_key is None or request.request_id in self.failed:
            return None
        params = request.sampling_params
        if (params is not None and params.skip_reading_prefix_cache) or state.prompt_tokens >= request.num_tokens:
            return None
        state.hit = self.contexts.find(state.context_key)
        return state.hit

    def take_context_plan(self) -> tuple[dict[str, tuple[int, int]], tuple[tuple[int, int], ...], tuple[int, ...]]:
        """For this step's plan: the requests starting from a shared context, the blocks to copy before the
        forward, the contexts released (`kvtrim.vllm.planning.StepPlan`); the next step starts."""
        adopted, copies, self._adopted, self._copies = self._adopted, tuple(self._copies), {}, []
        return adopted, copies, tuple(self.contexts.take_released())

    def _copy_on_write(self, request_id: str, state: TrimRequest, due: Due) -> Due:
        """Replace each block the compaction at `due` writes (the first `slots_held` slots) that another request
        holds or the prefix cache indexes by a fresh one (a spare, else a free block of the pool); `due` with the
        copies the worker makes first. The spares left go back to the pool."""
        blocks = self.req_to_blocks[request_id]
        copies = []
        for i in range(min(len(blocks), blocks_needed(slots_held(due), self.block_size))):
            old = blocks[i]
            if old.block_hash is None and old.ref_cnt == 1:
                continue
            if state.spare:
                new = state.spare.pop()
            elif self.block_pool.get_num_free_blocks() > 0:
                new = self.block_pool.get_new_blocks(1)[0]
            else:
                raise KvtrimError("no free KV block to copy its shared prompt blocks into before its compaction")
            blocks[i] = new
            state.replaced.append(old)
            copies.append((i, old.block_id, new.block_id))
        if state.spare:
            self.block_pool.free_blocks(state.spare)
            state.spare = []
        return replace(due, copies=tuple(copies))

    def compacted(self, request_id: str) -> int:
        """The step's planned compaction of request `request_id` ran: it has discarded the plan's count and
        keeps `slots_held` slots; its blocks past them go back to the pool. Returns the blocks freed."""
        state = self.states.get(request_id)
        due = None if state is None else state.due
        if due is None:
            return 0
        state.due, state.discarded = None, due.discarded
        if state.registers is not None:  # its context, compressed: shared from now on (its own blocks)
            context, state.registers = state.registers, None
            context.blocks = list(self.req_to_blocks[request_id][:context.kept // self.block_size])
            self.block_pool.touch(context.blocks)
            self.contexts.add(context)
            logger.info("kvtrim: request %s shares its context: %d tokens kept as %d entries in %d blocks (%s)",
                        request_id, context.tokens, context.kept, len(context.held()), self.contexts.describe())
        if state.replaced:  # copied: the old blocks go back (those in the prefix cache stay findable there)
            self.block_pool.free_blocks(reversed(state.replaced))
            state.replaced = []
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
        held = self._release(request_id)
        return super().pop_blocks_for_free(request_id) + held

    def _release(self, request_id: str) -> list:
        """The request ends or starts over; returns the blocks it held beside its block table."""
        state = self.states.get(request_id)
        if state is None:
            return []
        if state.registers is not None:  # its context will not be registered: the worker forgets its entries
            self.contexts.abandon(state.registers)
        held = state.restart()
        if state.request.is_finished():
            del self.states[request_id]
            self.failed.pop(request_id, None)
        elif state.shares:  # preempted: recomputed from its tokens (its prompt and what it generated) without the
            # prefix cache, whose copies on write its first compaction then (kept prompt + all it generated) could
            # need more of than its spares
            state.shares = False
            state.request.skip_reading_prefix_cache = True
        return held

    # -- blocks ---------------------------------------------------------------------------------------------

    def get_num_blocks_to_allocate(self, request_id, num_tokens, *args, apply_admission_cap=False, **kwargs):
        state = self.states.get(request_id)
        if state is None:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, *args,
                                                      apply_admission_cap=apply_admission_cap, **kwargs)
        if state.admitted:  # a running request: sized by what it stores
            return self._room(super().get_num_blocks_to_allocate(request_id, num_tokens - state.discarded, *args,
                                                                 **kwargs), running=True)
        if request_id in self.failed:  # (ended before vLLM's admission loop: `TrimScheduler.schedule`; a guard)
            return _NEVER
        try:
            peak = self._peak(state)  # (worked out at `start`)
            hit = state.hit
            if hit is not None:  # it starts from a shared context: blocks for its slots past the context's full ones
                blocks = max(0, blocks_needed(num_tokens - (hit.tokens - hit.kept), self.block_size) - len(hit.blocks))
                if apply_admission_cap:
                    return self._room(blocks, hit)
            elif apply_admission_cap:  # vLLM's full-sequence gate
                if state.block is not None:  # it never holds its whole prompt: its peak admits it
                    return 0
                return self._room(super().get_num_blocks_to_allocate(
                    request_id, num_tokens, *args, apply_admission_cap=True, **kwargs) + state.spares_to_take())
            else:
                blocks = super().get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs) + state.spares_to_take()
            if self.admission == "peak":
                # the free pool must hold what admitted requests may still take, and this one's peak if it reserves it
                blocks = max(blocks, 0 if peak is None or state.grows else peak) + self._debt()
            return self._room(blocks, hit)
        except Exception as err:  # noqa: BLE001 - one request's method must not stop the engine
            self.fail(request_id, f"admission: {one_line(err)}")
            return _NEVER

    def _room(self, blocks: int, reading: SharedContext | None = None, running: bool = False) -> int:
        """`blocks` (what an allocation needs), after releasing idle shared contexts (but `reading`, which the
        request being allocated starts from) until the pool has them free. For a waiting request (vLLM sizes its
        admission, then may not admit it) only when that makes them free: no context goes for an admission that
        fails anyway. For a `running` one, as many as are idle: vLLM preempts running requests for the rest."""
        if blocks > self.block_pool.get_num_free_blocks() and self.contexts.contexts:
            if reading is not None:
                self.contexts.read(reading)
            held = len(self.contexts.contexts)
            self.contexts.make_room(blocks, partly=running)
            if len(self.contexts.contexts) < held:
                logger.info("kvtrim: %d shared contexts released for room (%s)", held - len(self.contexts.contexts),
                            self.contexts.describe())
        return blocks

    def add_local_computed_blocks(self, request_id, new_computed_blocks, *args, **kwargs) -> None:
        state = self.states.get(request_id)
        if state is None or state.hit is None:
            return super().add_local_computed_blocks(request_id, new_computed_blocks, *args, **kwargs)
        # a shared context's full blocks, read-only: its readers write slots past them only
        self.block_pool.touch(state.hit.blocks)
        self.req_to_blocks[request_id].extend(state.hit.blocks)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        state = self.states.get(request_id)
        if state is None:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        context = None
        if not state.admitted:
            state.admitted = True
            state.reserved = state.peak if self.admission == "peak" and not state.grows else None
            if state.hit is not None:  # it starts from a shared context: stores its kept entries, caches nothing
                context, state.hit = state.hit, None
                state.reads, state.private = context, True
                state.discarded, state.counts = context.tokens - context.kept, copy.deepcopy(context.counts)
                self.contexts.read(context)
                self._adopted[request_id] = (context.id, state.discarded)
            if spares := state.spares_to_take():  # for the copies of its first compaction (`_copy_on_write`)
                state.spare = self.block_pool.get_new_blocks(spares)
        gone = state.discarded
        new = super().allocate_new_blocks(request_id, num_tokens - gone, num_tokens_main_model - gone)
        if context is not None and context.tail is not None:  # its own copy of the context's last block
            self._copies.append((context.tail.block_id, self.req_to_blocks[request_id][len(context.blocks)].block_id))
        return new

    def describe_held(self) -> str:
        """What this manager holds (the scheduler logs it when idle; a leak shows as a count above 0)."""
        return (f"{len(self.states)} requests, {len(self.failed)} failed to end, {self.contexts.describe()}, "
                f"{len(self.contexts.pending)} pending, {self.block_pool.get_num_free_blocks()} of "
                f"{self.block_pool.num_gpu_blocks - 1} blocks free")

    def _debt(self) -> int:
        """Blocks that admitted requests may still take to reach their peaks."""
        return sum(max(0, s.reserved - len(self.req_to_blocks.get(rid, ())))
                   for rid, s in self.states.items() if s.reserved is not None)

    def _total(self, state: TrimRequest) -> int:
        return request_total(state.request.num_prompt_tokens, state.request.max_tokens, self.max_model_len)

    def _peak(self, state: TrimRequest) -> int | None:
        """The blocks the request holds at most (`request_peak`; None: its method does not bound it), worked out
        once."""
        if not state.peak_known:
            state.peak, state.grows = request_peak(state.method, state.prompt_tokens, self._total(state),
                                                   self.block_size)
            state.peak_known = True
        return state.peak

    def _unfit(self, state: TrimRequest, peak: int | None) -> str | None:
        """Why the request can never run in this pool (`never_fits`), or None."""
        request = state.request
        return never_fits(state.method, request.num_prompt_tokens, request.max_tokens, self._total(state), peak,
                          self.block_size, self.block_pool.num_gpu_blocks - 1)  # vLLM keeps one null block
