"""Time `kvtrim.vllm.compact` alone, the way the worker calls it while a request decodes (no server):

    .venv-serve/bin/python benchmarks/serving/compaction.py
    PYTHONPATH=/tmp/old/src .venv-serve/bin/python benchmarks/serving/compaction.py   # another checkout's src

SmolLM2-135M's shapes (30 layers, 3 KV heads, head_dim 64, bf16, the CPU backend's 128-token blocks), random
keys and values, a 237-token prompt, then 1,199 decode steps; the scheduler's counts say which steps compact.
Prints, per method spec, the compactions, milliseconds per compaction and per decode step on average.
"""

import time

import torch

from kvtrim.vllm.compact import compact
from kvtrim.vllm.entries import RequestEntries
from kvtrim.vllm.planning import StoredCounts, forward_steps
from kvtrim.vllm.spec import method_for_vllm

LAYERS, HEADS, BLOCK, HEAD_DIM, BLOCKS, PROMPT, STEPS = 30, 3, 128, 64, 12, 237, 1199
SPECS = ("streaming:budget=512", "keydiff:budget=512", "lagkv:keep_ratio=0.125")


def main() -> None:
    torch.manual_seed(0)
    for spec in SPECS:
        method = method_for_vllm(spec)
        caches = [torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM).to(torch.bfloat16) for _ in range(LAYERS)]
        blocks, entries, counts = torch.arange(BLOCKS), RequestEntries(), StoredCounts(method)
        steps = forward_steps(0, PROMPT, PROMPT)
        if counts.advance(steps):
            compact(caches, blocks, method, entries, steps, PROMPT, PROMPT)
        start, done = time.perf_counter(), 0
        for end in range(PROMPT + 1, PROMPT + STEPS + 1):
            steps = forward_steps(end - 1, end, PROMPT)
            if counts.advance(steps):
                compact(caches, blocks, method, entries, steps, end, PROMPT)
                done += 1
        seconds = time.perf_counter() - start
        print(f"{spec}: {done} compactions, {1e3 * seconds / max(done, 1):.1f} ms each, "
              f"{1e3 * seconds / STEPS:.2f} ms per decode step")


if __name__ == "__main__":
    main()
