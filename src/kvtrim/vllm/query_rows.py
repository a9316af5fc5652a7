"""`QueryRows`: what a forward of kvtrim's worker copies for the methods that read queries or attention (a part of
`kvtrim.vllm.worker.TrimModelRunner`, one concept apart): a prompt (block)'s last query window, a due decode step's
probabilities or an append's queries, the attention sums of a prompt's rows (`kvtrim.vllm.attention.QueryTap`
copies them during the forward).

It uses the runner's `kvtrim_tap`, `kvtrim_attention`, `kvtrim_scales`, `kv_caches`, `query_start_loc`, `requests`,
`kvtrim_request`, `_kvtrim_sum_rows` and `_kvtrim_layout`.
"""

from __future__ import annotations

import torch

from kvtrim.methods.base import Phase
from kvtrim.vllm import attention
from kvtrim.vllm.block_io import add_prompt_sums
from kvtrim.vllm.entries import WorkerRequest
from kvtrim.vllm.planning import block_end, prompt_block
from kvtrim.vllm.spec import prompt_queries, prompt_sums


class QueryRows:
    """The query rows a forward copies per request (module docstring)."""

    def kvtrim_query_window(self, req_id: str) -> int:
        """How many of the last positions of request `req_id`'s prompt (or of each prompt block, `prompt_block`) its
        queries are copied for (0: none): what its method reads there (`prompt_queries()`). 0 without the hand-off
        (`kvtrim_attention` False): whatever reads the queries finds none and fails that request only."""
        method = self.kvtrim_method(req_id)
        if method is None or not method.needs_queries or not self.kvtrim_attention:
            return 0
        return prompt_queries(method)

    def kvtrim_prompt_queries(self, req_id: str) -> list[torch.Tensor] | None:
        """Request `req_id`'s last `kvtrim_query_window` queries of its prompt (block), per layer `(q_heads, W,
        head_dim)` post-RoPE in the model's dtype, once the forward that completes it has run; else None."""
        return self.kvtrim_tap.window(req_id)

    def _kvtrim_plan_rows(self, req_id: str, req: WorkerRequest, i: int, computed: int, scheduled: int, due) -> None:
        """Plan what this forward copies for request `req_id` (the batch's `i`-th, tokens `computed` ..
        `computed + scheduled - 1`, compacted after it when `due`): its prompt (block)'s last queries, a due decode
        step's probabilities or an append's queries, its prompt rows' attention sums."""
        prompt, method = req.prompt_tokens, req.method
        if computed < prompt and scheduled:  # a prompt forward: does it copy queries?
            self._kvtrim_plan_queries(req_id, i, computed, scheduled, prompt)
        if due is not None and due.steps[-1].phase is not Phase.PREFILL and self.kvtrim_attention and method.needs_attention:
            # its decode step's (or append's) queries: the compaction computes a decode step's probabilities
            row_end = int(self.query_start_loc.np[i] + scheduled)
            if method.attention_only_decode and len(due.steps) == 1 and due.steps[0].phase is Phase.DECODE:
                # its step's probabilities (and query), computed by the attention backend for all such requests at once
                self.kvtrim_tap.plan_probs(req_id, row_end - 1, self.requests[req_id].block_ids[0],
                                           computed + scheduled - req.discarded)
            else:
                self.kvtrim_tap.plan_last(req_id, row_end - due.steps[-1].tokens, row_end)
        if computed < prompt and scheduled and self.kvtrim_attention and prompt_sums(method):
            # every row of this forward (its prompt rows, then any tokens after the prompt: a recomputed request's)
            row_start = int(self.query_start_loc.np[i])
            self.kvtrim_tap.plan_last(req_id, row_start, row_start + scheduled)
            self._kvtrim_sum_rows[req_id] = (computed, min(scheduled, prompt - computed))

    def _kvtrim_plan_queries(self, req_id: str, row: int, computed: int, scheduled: int, prompt: int) -> None:
        """Plan the copy of the query rows of request `req_id` (the batch's `row`-th) that fall in the last window
        of its prompt block (the whole prompt, unless its method reads it in blocks: `prompt_block`), in this
        forward over positions `[computed, computed + scheduled)` (never across a block's end: the scheduler)."""
        window = self.kvtrim_query_window(req_id)
        if not window:
            return
        block = prompt_block(self.kvtrim_method(req_id))
        start, stop = (0, prompt) if block is None else (computed // block * block, block_end(computed, prompt, block))
        if computed == start:  # a block's first forward: an earlier block's window was read, or never will be
            self.kvtrim_tap.forget(req_id)
        window = min(window, stop - start)
        rows = attention.window_rows(computed, scheduled, stop, window)
        if rows is not None:
            first = int(self.query_start_loc.np[row]) - computed  # the query row of position 0
            lo, hi = rows
            self.kvtrim_tap.plan(req_id, first + lo, first + hi, lo - (stop - window), window)

    def _kvtrim_add_prompt_sums(self, req_id: str, computed: int, rows: int) -> None:
        """Add the column sums of the causal attention of request `req_id`'s prompt rows of this forward (positions
        `computed .. computed + rows - 1`) to its `WorkerRequest.prompt_sums` (`add_prompt_sums`), from the queries the tap
        copied; the queries are dropped (those of tokens after the prompt, a recomputed request's, stay for its
        compaction)."""
        queries = self.kvtrim_tap.take_last(req_id)
        if queries is None:
            return  # nothing copied: its compaction finds no sums and fails that request alone
        req, state = self.kvtrim_request(req_id), self.requests[req_id]
        method = req.method
        if rows < queries[0].shape[1]:
            self.kvtrim_tap.last[req_id] = {idx: q[:, rows:] for idx, q in enumerate(queries)}
        sums = req.prompt_sums
        if sums is None:
            h = self.kv_caches[0].shape[1]
            sums = req.prompt_sums = [torch.zeros(h, req.prompt_tokens) for _ in self.kv_caches]
        add_prompt_sums(sums, self.kv_caches, torch.tensor(state.block_ids[0], dtype=torch.long),
                        [q[:, :rows] for q in queries], computed, self.kvtrim_scales, method.prefill_block,
                        self._kvtrim_layout)
