"""What eviction costs one request in kvtrim's vLLM engine, without a server: the scheduler's planning
(`kvtrim.vllm.planning.plan_forward`, every forward) and the worker's compactions (`compact`, on the forwards
the plan marks due), on SmolLM2's shapes (30 layers, 3 KV heads, head_dim 64, bf16 blocks of 128 in a
56-block pool), one thread: the long-generation load's request (a 237-token prompt, then 2,000 decode steps).

    .venv-serve/bin/python benchmarks/serving/compact_cost.py [--threads N] [--layout vec|amx] [SPEC ...]
    # default: the long-generation load's methods (keydiff:budget=512 streaming:budget=512 lagkv:keep_ratio=0.125)

Prints per method: the planning per forward (µs, mean), the compactions while decoding (how many, median ms
each) and what both cost per decode step on average (ms): the number to set beside a decode step's time
(about 45 ms for 9-11 requests on this 2-core machine, i.e. 4-5 ms per request). A method fed attention
(TOVA, H2O, LazyEviction) gets random queries (9 query heads), as the worker hands it the captured ones: the
prompt's at its end (`prompt_queries`; H2O: random column sums instead, `prompt_sums`), each due forward's after it.
Its decode steps' probabilities, which the worker's attention backend computes for all such requests of a step at
once (`QueryTap.step_probs`), are timed apart ("backend probs ms": one request's, a batch of one, median) and left
out of the compactions.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kvtrim.specs import parse_method_spec
from kvtrim.vllm.compact import compact
from kvtrim.vllm.entries import RequestEntries
from kvtrim.vllm.planning import block_end, plan_forward, prompt_block
from kvtrim.vllm import kernels, layout as cpu_vec, layout_amx
from kvtrim.vllm.spec import prompt_queries, prompt_sums

LAYERS, KV_HEADS, Q_HEADS, BLOCK, HEAD_DIM, POOL, PROMPT, OUTPUT = 30, 3, 9, 128, 64, 56, 237, 2000
SPECS = ["keydiff:budget=512", "streaming:budget=512", "lagkv:keep_ratio=0.125"]


#: the block layouts of vLLM's CPU kernels, by `--layout` (default "vec"; "amx": the kernel this machine's vLLM runs
#: bf16 with, whose keys are laid out again before a product)
LAYOUTS = {"vec": cpu_vec, "amx": layout_amx}


def request_cost(spec: str, layout=cpu_vec, probs_fn=None) -> dict:
    """One request's planning and compactions under `spec` on the blocks of `layout`, timed (module docstring)."""
    probs_fn = probs_fn or kernels.torch_key_probs(layout)
    method = parse_method_spec(spec).build()
    # every layer's cache in one allocation, back to back, as vLLM allocates them (`layers_as_blocks`)
    caches = list(torch.randn(LAYERS, POOL, KV_HEADS, BLOCK, 2 * HEAD_DIM).bfloat16().unbind(0))
    blocks = torch.arange(0, -(-(PROMPT + OUTPUT) // BLOCK))
    entries, counts, discarded = RequestEntries(), None, 0
    fresh = torch.randn(2, PROMPT + OUTPUT, KV_HEADS, HEAD_DIM).bfloat16()  # (k/v, token, head, d)
    window = prompt_queries(method) if method.needs_queries else 0
    queries = [torch.randn(Q_HEADS, window, HEAD_DIM).bfloat16() for _ in range(LAYERS)] if window else None
    # H2O: its prompt's attention column sums instead (the worker adds them up per prefill chunk)
    sums = [torch.rand(KV_HEADS, PROMPT) for _ in range(LAYERS)] if prompt_sums(method) else None
    scales = [HEAD_DIM ** -0.5] * LAYERS
    block, start, forwards = prompt_block(method), 0, []
    while start < PROMPT:  # the prompt as the scheduler splits it (in blocks for KeyDiff budget=), then decoding
        stop = PROMPT if block is None else block_end(start, PROMPT, block)
        forwards.append((start, stop))
        start = stop
    forwards += [(PROMPT + i, PROMPT + i + 1) for i in range(OUTPUT)]
    plan_s, compactions, probs_s = [], [], []
    for computed, end in forwards:
        t0 = time.perf_counter()
        counts, due = plan_forward(counts, method, computed, end, PROMPT)
        t1 = time.perf_counter()
        hole = entries.fill_hole(computed)  # the worker's part of the forward: its first token may take a hole
        t2 = time.perf_counter()
        if computed >= PROMPT:  # the forward writes its token's entry (fresh: a moved entry's copy would tie)
            slot = torch.tensor([computed - discarded if hole is None else hole])
            for kv in caches:
                layout.write_entries(kv, blocks, torch.arange(KV_HEADS), slot.expand(KV_HEADS), *fresh[:, computed])
        t3 = time.perf_counter()
        if due is not None:
            last = ([torch.randn(Q_HEADS, end - max(computed, PROMPT), HEAD_DIM).bfloat16() for _ in range(LAYERS)]
                    if method.needs_attention and end > PROMPT else None)
            step_probs = None
            if method.attention_only_decode and end == computed + 1 > PROMPT:
                # the worker's attention backend computes a decode step's probabilities right after each layer's attention,
                # for every such request of the step at once: timed apart, one request's share (a batch of one)
                last, stored = torch.stack(last), end - discarded
                table = blocks[None, :-(-stored // BLOCK)]
                t_probs = time.perf_counter()
                step_probs = torch.stack([probs_fn(kv, table, q[None, :, 0], torch.tensor([stored]), scales[0])
                                           for kv, q in zip(caches, last)])
                step_probs = step_probs[:, 0, :, None, :stored]
                t3 += time.perf_counter() - t_probs
                probs_s.append(time.perf_counter() - t_probs)
            discarded = compact(caches, blocks, method, entries, due.steps, due.end, PROMPT, queries, scales, last,
                                sums if computed < PROMPT else None, layout, step_probs)
            if computed >= PROMPT:
                compactions.append(time.perf_counter() - t3 + t2 - t1)
        if computed >= PROMPT:
            plan_s.append(t1 - t0)
    return {"plan_us": 1e6 * statistics.mean(plan_s), "compactions": len(compactions),
            "compaction_ms": 1e3 * statistics.median(compactions) if compactions else 0.0,
            "probs_ms": 1e3 * statistics.median(probs_s) if probs_s else 0.0,
            "per_step_ms": 1e3 * (sum(plan_s) + sum(compactions)) / OUTPUT}


if __name__ == "__main__":
    args = sys.argv[1:]
    threads = 1  # `--threads N`: as many as the server's worker uses (its CPU cores), to see what small ops cost there
    if args[:1] == ["--threads"]:
        threads, args = int(args[1]), args[2:]
    layout = cpu_vec
    if args[:1] == ["--layout"]:
        layout, args = LAYOUTS[args[1]], args[2:]
    torch.set_num_threads(threads)
    # the backend's probabilities as the worker computes them: kvtrim's kernel (built in .venv-serve, which has ninja), or
    # the layout's torch function
    probs_fn, how = kernels.table_key_probs(layout)
    print(f"backend probabilities by {how}")
    print(f"{'method':<26} {'plan µs/step':>12} {'compactions':>11} {'ms each':>8} {'ms per decode step':>18} "
          f"{'backend probs ms':>17}")
    for spec in args or SPECS:
        r = request_cost(spec, layout, probs_fn)
        print(f"{spec:<26} {r['plan_us']:>12.1f} {r['compactions']:>11d} {r['compaction_ms']:>8.2f} "
              f"{r['per_step_ms']:>18.3f} {r['probs_ms']:>17.3f}")
