"""Edits of the worker's copies of a request's block table, made as the scheduler's manager edits its own list
(`kvtrim.vllm.manager`): the request's `block_ids` (vLLM's `CachedRequestState`) and its row of the input batch's
block table, which the next forward's slot mapping reads. One KV cache group (the worker refuses others)."""

from __future__ import annotations

from kvtrim.vllm.planning import blocks_needed


def replace_blocks(state, batch, req_id: str, index: list[int], new: list[int]) -> None:
    """Put block `new[i]` at `index[i]` of request `req_id`'s block table (copy on write: the manager replaced a
    shared block there by a fresh one, filled with its contents)."""
    ids = state.block_ids[0]
    table = batch.block_table[0]
    row = batch.req_id_to_index[req_id]
    for i, block in zip(index, new):
        ids[i] = block
        table.block_table.np[row, i] = block


def drop_tail_blocks(state, batch, req_id: str, slots: int) -> None:
    """Request `req_id`'s block ids past the `slots` it keeps (`slots_held`) leave its block table (the scheduler
    frees the same blocks after this step; later steps append new blocks after the kept ones)."""
    ids = state.block_ids[0]
    table = batch.block_table[0]
    keep = blocks_needed(slots, table.block_size)
    if len(ids) <= keep:
        return
    del ids[keep:]
    row = batch.req_id_to_index[req_id]
    table.block_table.np[row, keep:table.num_blocks_per_row[row]] = 0
    table.num_blocks_per_row[row] = keep
