"""What a decode step of many requests of one method costs the worker, each request decided alone (`compact`, one
after another) against all of them as one batch (`kvtrim.vllm.live_batch`), without a server: the long-generation
load's step, 11 requests on SmolLM2's shapes (30 layers, 3 KV heads, 9 query heads, head_dim 64, bf16 blocks of 128
in one allocation of 56 blocks per layer), each past its prompt (600-610 tokens: a budget of 512 reached at once;
LazyEviction: 500 tokens each, its requests batched only when they store the same count), then `--steps` decode
steps (TOVA, H2O: each evicts one entry per layer and KV head).

    .venv-serve/bin/python benchmarks/serving/batch_cost.py [--threads N] [--steps N] [SPEC ...]
    # default: 1 thread (the operations are small), 60 steps, tova:budget=512 h2o:budget=512
    # (lazyeviction:budget=512 evicts every 128 steps: --steps 130 includes one eviction)

Prints per method the median ms of a step's decisions for all requests, alone and batched, and whether both kept
the same entries. The step's probabilities (kvtrim's attention backend computes them for all requests at once in
either case: `logits_cost.py`) are computed before and left out of both.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

from kvtrim.specs import parse_method_spec
from kvtrim.vllm import kernels, layout_amx
from kvtrim.vllm.attention import QueryTap
from kvtrim.vllm.compact import compact
from kvtrim.vllm.entries import WorkerRequest
from kvtrim.vllm.live_batch import BatchRows, batch_groups, decide_group
from kvtrim.vllm.planning import Due, StoredCounts, forward_steps
from kvtrim.vllm.spec import prompt_queries, prompt_sums

LAYERS, KV_HEADS, Q_HEADS, BLOCK, HEAD_DIM, POOL, REQUESTS, PROMPT = 30, 3, 9, 128, 64, 56, 11, 600
SPECS = ["tova:budget=512", "h2o:budget=512"]
SCALE = HEAD_DIM ** -0.5


def setup(spec: str, probs_fn):
    """The pool and 11 requests of `spec` after their prompt and first decode step (each on its own decision layer)."""
    torch.manual_seed(0)
    caches = list(torch.randn(LAYERS, POOL, KV_HEADS, BLOCK, 2 * HEAD_DIM).bfloat16().unbind(0))
    requests = []
    for r in range(REQUESTS):
        method = parse_method_spec(spec).build()
        # prompts of different lengths (a batch rebases positions); one length where the count grows between
        # evictions (LazyEviction: requests of one batch store the same count; 500 tokens, so that its peak at its
        # first eviction, 628 entries, fits the request's 5 blocks)
        req = WorkerRequest(method, prompt_tokens=PROMPT + r if method.in_place_decode else 500)
        blocks = torch.arange(5 * r, 5 * r + 5)
        counts, gone = StoredCounts(method), 0
        prompt = req.prompt_tokens
        for start, end in ((0, prompt), (prompt, prompt + 1)):
            steps = forward_steps(start, end, prompt)
            if not counts.advance(steps):  # (LazyEviction keeps its prompt whole)
                continue
            queries = sums = last = step_probs = None
            if start == 0:
                queries = [torch.randn(Q_HEADS, prompt_queries(method), HEAD_DIM).bfloat16() for _ in range(LAYERS)]
                if prompt_sums(method):
                    queries, sums = None, [torch.rand(KV_HEADS, end) for _ in range(LAYERS)]
            else:
                step_probs, last = step_of(caches, blocks, end - gone, probs_fn)
                step_probs = step_probs[:, :, None]
                last = last[:, :, None]
            gone = compact(caches, blocks, method, req.entries, steps, end, req.prompt_tokens, queries,
                           [SCALE] * LAYERS, last, sums, layout_amx, step_probs)
        requests.append((str(r), req, blocks, counts))
    return caches, requests


def step_of(caches, blocks, stored: int, probs_fn):
    """A decode step's probabilities `(layers, q_heads, stored)` over a request's blocks and its queries `(layers, q_heads,
    head_dim)`, as kvtrim's attention backend computes them."""
    queries = torch.randn(LAYERS, Q_HEADS, HEAD_DIM).bfloat16()
    table = blocks[None, :-(-stored // BLOCK)]
    lengths = torch.tensor([stored])
    probs = torch.stack([probs_fn(kv, table, q[None], lengths, SCALE)[0] for kv, q in zip(caches, queries)])
    return probs[..., :stored], queries


def run(spec: str, steps: int, probs_fn) -> tuple[float, float, bool]:
    caches, requests = setup(spec, probs_fn)
    twin_caches = list(torch.stack(caches).unbind(0))  # a second pool, in one allocation too
    twins = copy.deepcopy(requests)
    alone_s, batch_s = [], []
    for _ in range(steps):
        tap, due, inputs = QueryTap(), [], []
        for req_id, req, blocks, counts in requests:
            end, before = req.entries.seen + 1, counts.discarded
            counts.advance(forward_steps(end - 1, end, req.prompt_tokens))
            stored = end - before  # before the step's eviction (LazyEviction's steps between evictions discard none)
            entry = torch.randn(2, LAYERS, KV_HEADS, HEAD_DIM).bfloat16()
            for kv, twin, k, v in zip(caches, twin_caches, *entry):  # the step's entry where the engine writes it
                for pool in (kv, twin):
                    layout_amx.write_entries(pool, blocks, torch.arange(KV_HEADS), torch.full((KV_HEADS,), stored - 1),
                                             k, v)
            inputs.append(step_of(caches, blocks, stored, probs_fn))
            due.append((req_id, Due(forward_steps(end - 1, end, req.prompt_tokens), end, counts.discarded), end))
        start = time.perf_counter()
        for (req_id, req, blocks, _), (probs, queries), (_, plan, end) in zip(twins, inputs, due):
            compact(twin_caches, blocks, req.method, req.entries, plan.steps, end, req.prompt_tokens, None,
                    [SCALE] * LAYERS, queries[:, :, None], None, layout_amx, probs[:, :, None].clone())
        alone_s.append(time.perf_counter() - start)
        width = max(probs.shape[-1] for probs, _ in inputs)
        tap.probs = torch.stack([torch.nn.functional.pad(probs, (0, width - probs.shape[-1])) for probs, _ in inputs])
        tap.prob_queries = torch.stack([queries for _, queries in inputs])
        tap.prob_index = {req_id: (r, probs.shape[-1])
                          for r, ((req_id, *_), (probs, _)) in enumerate(zip(requests, inputs))}
        start = time.perf_counter()
        reqs = {req_id: req for req_id, req, _, _ in requests}
        groups, rest = batch_groups(due, reqs.get, tap.prob_index, True)
        for items in groups:
            ids = [i for i, _, _ in items]
            decide_group(caches, [reqs[i] for i in ids], ids, [requests[int(i)][2].tolist() for i in ids],
                         [end for *_, end in items], tap, SCALE, layout_amx)
        batch_s.append(time.perf_counter() - start)
        if rest:  # (the first step: each request joins from its own layer; none is left alone after it)
            raise SystemExit(f"{len(rest)} requests were not batched")
    same = all(torch.equal(a.entries.live.own_rows()[0][..., :a.entries.live.batch.stored].sort(-1).values,
                           torch.stack(b.entries.positions).sort(-1).values)
               for (_, a, _, _), (_, b, _, _) in zip(requests, twins) if isinstance(a.entries.live, BatchRows))
    same = same and all(torch.equal(a, b) for a, b in zip(caches, twin_caches))
    return 1e3 * statistics.median(alone_s), 1e3 * statistics.median(batch_s), same


if __name__ == "__main__":
    args = sys.argv[1:]
    threads, steps = 1, 60
    while args[:1] in (["--threads"], ["--steps"]):
        if args[0] == "--threads":
            threads = int(args[1])
        else:
            steps = int(args[1])
        args = args[2:]
    torch.set_num_threads(threads)
    probs_fn, how = kernels.table_key_probs(layout_amx)
    print(f"step probabilities by {how}; {REQUESTS} requests, {steps} decode steps, {threads} thread(s)")
    print(f"{'method':<20} {'alone ms/step':>13} {'batched ms/step':>15} {'ratio':>6} {'same entries':>12}")
    for spec in args or SPECS:
        alone, batched, same = run(spec, steps, probs_fn)
        print(f"{spec:<20} {alone:>13.2f} {batched:>15.2f} {alone / batched:>6.1f} {str(same):>12}")
