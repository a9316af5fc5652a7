"""Test only: kvtrim's worker whose runner copies the prompt-window queries a request asks for in its
`SamplingParams.extra_args` (`{"probe": NAME, "probe_window": W}`), instead of only those its method needs
(a request that gives no `probe_window` gets its method's: SnapKV's). Put this folder on PYTHONPATH and pass
`worker_cls="kvtrim_attention_probe.ProbeWorker"` (tests/test_vllm_attention.py); `probe_report(path)`
(through `collective_rpc`) saves with `torch.save` what the tests check:

* `impls`: attention layer name -> its impl's class name; `attention`: the runner's `kvtrim_attention`;
* `windows`: NAME -> the request's captured window `(layers, q_heads, W, head_dim)` (kept after it ends);
* `plans`: NAME -> the `(row_start, row_end, at)` planned in each forward that copied rows of it;
* `steps`: forwards run, and per NAME the forwards it was in; `copies`: the tap's copies so far;
* `kept`: NAME -> the token positions its blocks hold after its prompt's compaction, per layer and KV head
  `(layers, kv_heads, n_keep)` sorted; `latest`: NAME -> (its token count, those positions) after its latest
  compaction; `failed`: NAME -> why its compaction failed (one line);
* `probe_tamper: N` in a request's `extra_args`: its plan at its first decode step decided in a batch at token
  `prompt + N` or later is one entry off (a plan the worker's count disagrees with, as a method breaking the
  engine's contract would make it);
* `sum_chunks`: NAME -> the `(first position, rows)` of each prefill chunk whose attention sums were added
  (H2O); `sums_held`: the NAMEs whose prompt sums the runner still holds.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtrim.vllm.live_batch import batch_groups
from kvtrim.vllm.worker import TrimCPUWorker, TrimModelRunner


class ProbeRunner(TrimModelRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe_windows: dict[str, torch.Tensor] = {}
        self.probe_plans: dict[str, list] = {}
        self.probe_in_steps: dict[str, int] = {}
        self.probe_steps = 0
        self.probe_kept: dict[str, torch.Tensor] = {}
        self.probe_latest: dict[str, tuple[int, torch.Tensor]] = {}
        self.probe_failed: dict[str, str] = {}
        self.probe_sum_chunks: dict[str, list] = {}
        self.probe_tampered: set[str] = set()

    def _probe_args(self, req_id: str) -> dict:
        params = self.requests[req_id].sampling_params
        return (params.extra_args or {}) if params is not None else {}

    def kvtrim_query_window(self, req_id: str) -> int:
        args = self._probe_args(req_id)
        return int(args["probe_window"]) if "probe_window" in args else super().kvtrim_query_window(req_id)

    def _kvtrim_fail(self, req_id: str, plan, err: Exception) -> None:
        super()._kvtrim_fail(req_id, plan, err)
        self.probe_failed[self._probe_args(req_id).get("probe", req_id)] = self._kvtrim_failed[req_id]

    def _compact(self, req_id: str, plan, end: int) -> None:
        super()._compact(req_id, plan, end)
        name = self._probe_args(req_id).get("probe", req_id)
        if req_id not in self._kvtrim_failed:
            positions = torch.stack([p.sort(dim=-1).values for p in self.kvtrim_requests[req_id].entries.positions])
            self.probe_latest[name] = (end, positions)
            if plan.steps[0].ends_prompt:  # the prompt's compaction
                self.probe_kept[name] = positions

    def _kvtrim_batches(self, due: list) -> list:
        # `probe_tamper: N`: the request's first decode step decided in a batch at token `prompt + N` or later has a
        # plan one entry off (what the worker keeps disagrees with it, as a method breaking the contract would do)
        groups, _ = batch_groups(due, self.kvtrim_request, self.kvtrim_tap.prob_index, True)
        grouped = {req_id for items in groups for req_id, _, _ in items}
        for k, (req_id, plan, end) in enumerate(due):
            tamper = self._probe_args(req_id).get("probe_tamper")
            if (req_id in grouped and tamper is not None and req_id not in self.probe_tampered
                    and end >= self.requests[req_id].num_prompt_tokens + tamper):
                self.probe_tampered.add(req_id)
                due[k] = (req_id, replace(plan, discarded=plan.discarded + 1), end)
        return super()._kvtrim_batches(due)

    def _kvtrim_add_prompt_sums(self, req_id: str, computed: int, rows: int) -> None:
        super()._kvtrim_add_prompt_sums(req_id, computed, rows)
        name = self._probe_args(req_id).get("probe", req_id)
        self.probe_sum_chunks.setdefault(name, []).append((computed, rows))

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self.probe_steps += 1
        for req_id in self.input_batch.req_ids[:self.input_batch.num_reqs]:
            name = self._probe_args(req_id).get("probe", req_id)
            self.probe_in_steps[name] = self.probe_in_steps.get(name, 0) + 1
            if req_id in self.kvtrim_tap.rows:
                self.probe_plans.setdefault(name, []).append(self.kvtrim_tap.rows[req_id])
        return out

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        out = super().execute_model(scheduler_output, intermediate_tensors)
        for req_id in list(self.kvtrim_tap.windows):
            name = self._probe_args(req_id).get("probe", req_id)
            window = self.kvtrim_prompt_queries(req_id)
            if window is not None and name not in self.probe_windows:
                self.probe_windows[name] = torch.stack(window).clone()
        return out


class ProbeWorker(TrimCPUWorker):
    runner_cls = ProbeRunner

    def probe_report(self, path: str) -> None:
        runner = self.model_runner
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        layers = get_layers_from_vllm_config(runner.vllm_config, Attention)
        torch.save({"impls": {name: type(layer.impl).__name__ for name, layer in layers.items()},
                    "attention": runner.kvtrim_attention, "windows": runner.probe_windows,
                    "plans": runner.probe_plans, "steps": runner.probe_steps, "in_steps": runner.probe_in_steps,
                    "copies": runner.kvtrim_tap.copies, "probs_taken": runner.kvtrim_tap.probs_taken, "attended": runner.kvtrim_tap.attended, "kept": runner.probe_kept, "latest": runner.probe_latest, "failed": runner.probe_failed,
                    "sum_chunks": runner.probe_sum_chunks,
                    "sums_held": [runner._probe_args(r).get("probe", r) for r, state in runner.kvtrim_requests.items()
                                  if state.prompt_sums is not None]},
                   path)
