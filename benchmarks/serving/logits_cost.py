"""What a decode step's logits cost the worker's attention backend for a batch of requests: the layout's torch
function (`table_key_logits`: the requests' key blocks gathered into a copy, then one product) against kvtrim's C++
kernel (`kvtrim.vllm.kernels`: the blocks read where they lie), every layer of SmolLM2's shapes (30 layers, 3 KV
heads, 9 query heads, head_dim 64, bf16 blocks of 128 in one allocation of 56 blocks per layer), 11 requests of 5
blocks each: the long-generation load's step.

    .venv-serve/bin/python benchmarks/serving/logits_cost.py [--threads N]   # default 2 (the server's worker)

Prints, per layout ("amx": the kernel this machine's vLLM runs bf16 with; "vec"), the median ms of the step's
logits (all layers, 20 repeats) for each function, and the largest difference between them.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvtrim.vllm import kernels, layout as cpu_vec, layout_amx

LAYERS, POOL, KV_HEADS, BLOCK, HEAD_DIM, Q_HEADS, REQUESTS, BLOCKS = 30, 56, 3, 128, 64, 9, 11, 5


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


if __name__ == "__main__":
    args = sys.argv[1:]
    torch.set_num_threads(int(args[1]) if args[:1] == ["--threads"] else 2)
    torch.manual_seed(0)
    caches = list(torch.randn(LAYERS, POOL, KV_HEADS, BLOCK, 2 * HEAD_DIM).bfloat16().unbind(0))
    table = torch.stack([torch.randperm(POOL)[:BLOCKS] for _ in range(REQUESTS)])
    queries = torch.randn(LAYERS, REQUESTS, Q_HEADS, HEAD_DIM).bfloat16()
    print(f"{'layout':<6} {'torch ms':>9} {'kernel ms':>9} {'max |diff|':>10}   ({torch.get_num_threads()} threads)")
    for name, layout in (("amx", layout_amx), ("vec", cpu_vec)):
        kernel, how = kernels.table_key_logits(layout)
        if kernel is layout.table_key_logits:
            print(f"{name:<6} no kernel: {how}")
            continue
        torch_ms = median_ms(lambda: [layout.table_key_logits(kv, table, q) for kv, q in zip(caches, queries)])
        kernel_ms = median_ms(lambda: [kernel(kv, table, q) for kv, q in zip(caches, queries)])
        diff = max(float((layout.table_key_logits(kv, table, q).float() - kernel(kv, table, q).float()).abs().max())
                   for kv, q in zip(caches, queries))
        print(f"{name:<6} {torch_ms:>9.2f} {kernel_ms:>9.2f} {diff:>10.4f}")
