"""What a decode step's logits cost the worker's attention backend for a batch of requests: the layout's torch
function (`table_key_logits`: the requests' key blocks gathered into a copy, then one product) against kvtrim's C++
kernel (`kvtrim.vllm.kernels`: the blocks read where they lie), every layer of SmolLM2's shapes (30 layers, 3 KV
heads, 9 query heads, head_dim 64, bf16 blocks of 128 in one allocation of 56 blocks per layer), 11 requests of 5
blocks each: the long-generation load's step.

    .venv-serve/bin/python benchmarks/serving/logits_cost.py [--threads N]   # default 2 (the server's worker)

Prints, per layout ("amx": the kernel this machine's vLLM runs bf16 with; "vec"), the median ms of the step's
logits (all layers, 20 repeats) for each function, and the largest difference between them; then what the worker's
backend runs since 2026-12-07, the step's probabilities over each request's 513 entries (`table_key_probs`: the
logits, scaled, softmax, in the kernel; torch's `softmax_probabilities` on the layout's logits); beside them, what
vLLM's own decode attention over the same blocks costs (`cpu_attention_with_kv_cache`, the layout's ISA, every
layer): the most the logits could save by being computed inside that pass; then vLLM's attention with the
probabilities right after each layer's (what the worker's backend ran until 2026-12-07 15:30) against kvtrim's kernel
computing both in one pass (`kernels.table_attention`: what it runs since when a step's forward is only such decode
steps).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvtrim.vllm import kernels, layout as cpu_vec, layout_amx

LAYERS, POOL, KV_HEADS, BLOCK, HEAD_DIM, Q_HEADS, REQUESTS, BLOCKS = 30, 56, 3, 128, 64, 9, 11, 5


def vllm_attention(isa: str, caches, table: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor, after=None):
    """vLLM's CPU decode attention (`cpu_attention_with_kv_cache`, ISA `isa`) of every layer's `queries` `(R,
    q_heads, head_dim)` over the requests' first `lengths` entries in their blocks `table` `(R, U)`, as its backend
    calls it (`after(kv, q)`, if given, right after each layer's: what kvtrim's backend ran before 2026-12-07 15:30);
    None without vLLM (or, for "amx", on a CPU without AMX tiles)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if isa == "amx" and not torch.cpu._init_amx():  # (vLLM's worker enables the tiles the same way)
        return None
    requests, used = table.shape
    seq_lens = lengths.int()
    starts = torch.arange(requests + 1, dtype=torch.int32)  # one query row per request: decode steps
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=requests, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=torch.bfloat16, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=True, dynamic_causal=None, kv_cache_dtype="auto")
    out = torch.empty(requests, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    table = table.int()

    def run():
        for kv, q in zip(caches, queries):
            keys, values = kv.view(POOL, KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=keys, value_cache=values, output=out, query_start_loc=starts, seq_lens=seq_lens,
                scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                softcap=0.0, scheduler_metadata=metadata, s_aux=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return run


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
    lengths = torch.full((REQUESTS,), 4 * BLOCK + 1)  # the load's requests past a budget of 512, the step's token
    print(f"{'layout':<6} {'torch ms':>9} {'kernel ms':>9} {'max |diff|':>10} {'probs torch ms':>14} "
          f"{'probs kernel ms':>15} {'vLLM attention ms':>17} {'vLLM attn + probs ms':>20} {'kernel attn+probs ms':>20}"
          f"   ({torch.get_num_threads()} threads)")
    for name, layout in (("amx", layout_amx), ("vec", cpu_vec)):
        kernel, how = kernels.table_key_logits(layout)
        if kernel is layout.table_key_logits:
            print(f"{name:<6} no kernel: {how}")
            continue
        torch_ms = median_ms(lambda: [layout.table_key_logits(kv, table, q) for kv, q in zip(caches, queries)])
        kernel_ms = median_ms(lambda: [kernel(kv, table, q) for kv, q in zip(caches, queries)])
        diff = max(float((layout.table_key_logits(kv, table, q).float() - kernel(kv, table, q).float()).abs().max())
                   for kv, q in zip(caches, queries))
        probs, _ = kernels.table_key_probs(layout)
        by_torch = kernels.torch_key_probs(layout)
        probs_torch_ms = median_ms(lambda: [by_torch(kv, table, q, lengths, HEAD_DIM ** -0.5)
                                            for kv, q in zip(caches, queries)])
        probs_ms = median_ms(lambda: [probs(kv, table, q, lengths, HEAD_DIM ** -0.5) for kv, q in zip(caches, queries)])
        fused = kernels.table_attention(layout)
        fused_ms = median_ms(lambda: [fused(kv, table, q, lengths, HEAD_DIM ** -0.5) for kv, q in zip(caches, queries)])
        attend = vllm_attention(name, caches, table, queries, lengths)
        then_probs = vllm_attention(name, caches, table, queries, lengths,
                                    after=lambda kv, q: probs(kv, table, q, lengths, HEAD_DIM ** -0.5))
        attention = "-" if attend is None else f"{median_ms(attend):.2f}"
        both = "-" if then_probs is None else f"{median_ms(then_probs):.2f}"
        print(f"{name:<6} {torch_ms:>9.2f} {kernel_ms:>9.2f} {diff:>10.4f} {probs_torch_ms:>14.2f} {probs_ms:>15.2f} "
              f"{attention:>17} {both:>20} {fused_ms:>20.2f}")
