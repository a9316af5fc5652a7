"""The cost of one request's compaction in kvtrim's vLLM worker, without a server: `kvtrim.vllm.compact.compact`
on SmolLM2's shapes (30 layers, 3 KV heads, head_dim 64, bf16 blocks of 128 in a 56-block pool), one thread.

    .venv/bin/python benchmarks/serving/compact_cost.py [SPEC ...]     # default: streaming:budget=512

A request with a 237-token prompt is compacted at its prompt's end, then after every decode step (as the
worker does when the scheduler marks a step due; for StreamingLLM with a budget every step is due once the
budget is reached). Prints the median wall time of 200 decode-step compactions after 300 warm-up steps.
Methods that are due only every `block_size` steps (KeyDiff, LagKV's reference mode) are not measured here:
the worker compacts them only on due steps.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvtrim.methods.base import Phase
from kvtrim.specs import parse_method_spec
from kvtrim.vllm.compact import RequestEntries, compact

LAYERS, KV_HEADS, BLOCK, HEAD_DIM, POOL, PROMPT = 30, 3, 128, 64, 56, 237


def median_compaction_ms(spec: str, warmup: int = 300, measured: int = 200) -> float:
    method = parse_method_spec(spec).build()
    caches = [torch.randn(POOL, KV_HEADS, BLOCK, 2 * HEAD_DIM).bfloat16() for _ in range(LAYERS)]
    blocks = torch.arange(0, -(-(PROMPT + warmup + measured) // BLOCK))
    entries = RequestEntries()
    compact(caches, blocks, method, entries, [(Phase.PREFILL, True, PROMPT)], PROMPT, PROMPT)
    end, times = PROMPT, []
    for step in range(warmup + measured):
        end += 1
        start = time.perf_counter()
        compact(caches, blocks, method, entries, [(Phase.DECODE, False, 1)], end, PROMPT)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for spec in sys.argv[1:] or ["streaming:budget=512"]:
        print(f"{spec}: {median_compaction_ms(spec):.2f} ms per decode-step compaction (median of 200)")
