"""Tensor-parallel ranks agreeing on the step's failed requests.

Every rank of a tensor-parallel server compacts its own KV heads by the same plan, so the same requests are due
on every rank in the same step; a compaction may still fail on one rank only (a method raising there). vLLM hands
the scheduler one rank's output (rank 0's), so after each step with compactions the ranks gather their failures
(one `all_gather_object` over vLLM's tensor-parallel CPU group) and every rank names them all: the scheduler
ends each such request, whichever rank it failed on.
"""

from __future__ import annotations

import torch


def gather_failures(failed: dict[str, str]) -> dict[str, str]:
    """Every rank's `failed` (req_id -> why) of this step, merged (the lowest rank's line first); `failed` itself
    on one worker. Called by every rank in the same steps (those with compactions: the plan's, the same on all)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return failed
    gathered: list = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, failed, group=group.cpu_group)
    merged: dict[str, str] = {}
    for rank, rank_failed in enumerate(gathered):
        for req_id, why in rank_failed.items():
            merged.setdefault(req_id, why if rank == 0 else f"{why} (on tensor-parallel rank {rank})")
    return merged
