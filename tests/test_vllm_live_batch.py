"""Decode steps of many requests decided as one batch (`kvtrim.vllm.live_batch`) against each request decided alone
(`compact`, as it was before batches): the same kept positions after every step, the same blocks at the end, while
requests leave the batch for a step of their own and come back (run from .venv-serve; skipped without vLLM)."""

import pytest
import torch

pytest.importorskip("vllm._custom_ops", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")

from kvtrim.methods.lazy_eviction import _LazyState  # noqa: E402
from kvtrim.vllm import layout as cpu_vec  # noqa: E402
from kvtrim.vllm.attention import QueryTap  # noqa: E402
from kvtrim.vllm.block_io import add_prompt_sums  # noqa: E402
from kvtrim.vllm.compact import compact  # noqa: E402
from kvtrim.vllm.entries import WorkerRequest  # noqa: E402
from kvtrim.vllm.kernels import torch_key_probs  # noqa: E402
from kvtrim.vllm.layout import read_request  # noqa: E402
from kvtrim.vllm.live_batch import BatchRows, batch_groups, batch_key, decide_group  # noqa: E402
from kvtrim.vllm.planning import Due, StoredCounts, forward_steps  # noqa: E402
from kvtrim.vllm.spec import method_for_vllm, prompt_queries, prompt_sums  # noqa: E402
from test_vllm_layout import BS, D, H, kernel_write, request_slots  # noqa: E402

LAYERS, Q_HEADS, SCALE, POOL = 3, 3 * H, 0.125, 16
PROMPTS = (50, 61, 45)  # different lengths: the batch rebases each request's positions
BLOCKS = ([3, 7], [0, 9], [5, 1])


class Request:
    """One request's keys, values and queries (every token it will see), its blocks and what the engine knows."""

    def __init__(self, spec, prompt, blocks, total, seed):
        torch.manual_seed(seed)
        self.prompt, self.blocks = prompt, torch.tensor(blocks)
        self.keys = [(torch.randn(H, total, D) * torch.linspace(0.5, 2, D)) for _ in range(LAYERS)]
        self.values = [torch.randn(H, total, D) for _ in range(LAYERS)]
        self.queries = [(torch.randn(Q_HEADS, total, D) * torch.linspace(0.5, 2, D)) for _ in range(LAYERS)]
        self.worker = WorkerRequest(method_for_vllm(spec), prompt_tokens=prompt)
        self.counts, self.gone, self.end = StoredCounts(self.worker.method), 0, 0

    def write(self, caches, end):
        """The forward up to token `end` writes its entries where the engine writes them; returns its `Due`."""
        start, self.end = self.end, end
        for cache, k, v in zip(caches, self.keys, self.values):
            kernel_write(cache, k[:, start:end].transpose(0, 1).contiguous(),
                         v[:, start:end].transpose(0, 1).contiguous(),
                         request_slots(self.blocks, end - self.gone)[start - self.gone:])
        steps = forward_steps(start, end, self.prompt)
        due = self.counts.advance(steps)
        return Due(steps, end, self.counts.discarded) if due else None

    def step_probs(self, caches):
        """The step's probabilities `(layers, q_heads, stored_blocks * BS)` and queries `(layers, q_heads, D)`, as
        kvtrim's attention backend computes them (torch's function: the kernel's rounding is not what is tested)."""
        stored, t = self.end - self.gone, self.end - 1
        table, lengths = self.blocks[None, :-(-stored // BS)], torch.tensor([stored])
        probs = torch.stack([torch_key_probs(cpu_vec)(kv, table, q[None, :, t], lengths, SCALE)[0]
                             for kv, q in zip(caches, self.queries)])
        return probs, torch.stack([q[:, t] for q in self.queries])


def compact_alone(caches, req, due, probs=None, queries=None):
    """`compact` for one request, as the worker runs it outside a batch."""
    method, prompt = req.worker.method, req.prompt
    sums = window = None
    if due.steps[0].phase.value == "prefill":
        if prompt_sums(method):
            sums = [torch.zeros(H, prompt) for _ in range(LAYERS)]
            for c in range(0, prompt, 16):
                add_prompt_sums(sums, caches, req.blocks, [q[:, c:min(c + 16, prompt)] for q in req.queries], c,
                                [SCALE] * LAYERS, method.prefill_block)
        else:
            window = [q[:, prompt - prompt_queries(method):prompt] for q in req.queries]
    step_probs = None if probs is None else probs[..., None, :req.end - req.gone].clone()
    last = queries[:, :, None] if queries is not None else None
    req.gone = compact(caches, req.blocks, method, req.worker.entries, due.steps, due.end, prompt, window,
                       [SCALE] * LAYERS, last, sums, step_probs=step_probs)
    assert req.gone == due.discarded


def kept_positions(entries):
    """`(layers, h, stored)` positions of a request's stored entries, sorted (its batch's rows when it has one)."""
    if isinstance(entries.live, BatchRows):
        positions = entries.live.own_rows()[0][..., :entries.live.batch.stored]  # (without a free last slot)
    else:
        positions = torch.stack(entries.positions)
    return positions.sort(dim=-1).values


@pytest.mark.parametrize("spec,prompts", [("tova:budget=40", PROMPTS), ("h2o:budget=40", PROMPTS),
                                          ("h2o:heavy_budget=10:recent_budget=20", PROMPTS),
                                          # its count grows between evictions: one prompt length for all
                                          ("lazyeviction:budget=40:window=8:alpha=0.02", (50, 50, 50))])
def test_batched_decode_steps_keep_what_each_request_keeps_alone(spec, prompts):
    """TOVA, H2O (in place, one entry out per step) and LazyEviction (every `window` steps, back to its budget: at
    steps 8, 16, 24, the first while request 1 steps alone)."""
    steps, alone_at = 30, {8: 1, 9: 1, 20: 0}  # step -> the request whose step is decided alone (it leaves the batch)
    total = max(prompts) + steps + 1
    batched = [Request(spec, p, b, total, seed=i) for i, (p, b) in enumerate(zip(prompts, BLOCKS))]
    alone = [Request(spec, p, b, total, seed=i) for i, (p, b) in enumerate(zip(prompts, BLOCKS))]
    caches = list(torch.zeros(LAYERS, POOL, H, BS, 2 * D).unbind(0))  # one allocation, as vLLM's
    reference = list(torch.zeros(LAYERS, POOL, H, BS, 2 * D).unbind(0))
    for reqs, kv in ((batched, caches), (alone, reference)):
        for req in reqs:  # the prompt, then one decode step alone: each request gets its own live layer
            for end in (req.prompt, req.prompt + 1):
                due = req.write(kv, end)  # (LazyEviction keeps its prompt whole: nothing due at its end)
                if due is not None:
                    compact_alone(kv, req, due, *(req.step_probs(kv) if end > req.prompt else ()))
    formed = {}  # id -> the batch itself: held, so that no id is reused by a later batch
    for step in range(steps):
        tap, due = QueryTap(), []
        stepped = []
        for req in batched:  # the step's forward: each request's entry written, its probabilities computed
            assert req.write(caches, req.end + 1) is not None
            stepped.append(req.step_probs(caches))
        tap.probs = torch.stack([s[0] for s in stepped])
        tap.prob_queries = torch.stack([s[1] for s in stepped])
        for r, req in enumerate(batched):
            plan = Due(forward_steps(req.end - 1, req.end, req.prompt), req.end, req.counts.discarded)
            if alone_at.get(step) == r:  # not in the batch this step: decided alone (its rows come back to it)
                probs, queries = stepped[r]
                compact_alone(caches, req, plan, probs, queries)
            else:
                tap.prob_index[str(r)] = (r, req.end - req.gone)
                due.append((str(r), plan, req.end))
        requests = {str(r): req.worker for r, req in enumerate(batched)}
        groups, rest = batch_groups(due, requests.get, tap.prob_index, True)
        assert rest == [] and len(groups) == 1 and len(groups[0]) == len(due)
        ids = [req_id for req_id, _, _ in groups[0]]
        members = [batched[int(i)] for i in ids]
        stored = decide_group(caches, [m.worker for m in members], ids, [m.blocks.tolist() for m in members],
                              [m.end for m in members], tap, SCALE, cpu_vec)
        for m in members:
            m.gone = m.end - stored
            assert m.gone == m.counts.discarded
            formed[id(m.worker.entries.live.batch)] = m.worker.entries.live.batch
        for req in alone:
            compact_alone(reference, req, req.write(reference, req.end + 1), *req.step_probs(reference))
        for b, a in zip(batched, alone):
            assert torch.equal(kept_positions(b.worker.entries), kept_positions(a.worker.entries))
    # formed at step 0, 8 (two members: 9 keeps it), 10, 20 (two) and 21
    assert len(formed) == 5
    if spec.startswith("lazyeviction"):  # its prompts kept whole, its evictions into position order: the step's
        assert all(b.live.by_position is None for b in formed.values())  # probabilities never gathered
    for b, a in zip(batched, alone):  # the blocks hold the same entries in the same slots
        for kv, ref in zip(caches, reference):
            got, want = read_request(kv, b.blocks, b.end - b.gone), read_request(ref, a.blocks, a.end - a.gone)
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_requests_that_differ_are_not_batched_together():
    """A group shares its method and parameters, its stored count, its prompt's length where the budget follows
    from it, and what of the method's state is not per row (LazyEviction's count of decode steps)."""
    tova, h2o = method_for_vllm("tova:budget=40"), method_for_vllm("h2o:budget=40")
    ratio = method_for_vllm("tova:compression_ratio=0.5")
    assert batch_key(tova, 40, 50, None) == batch_key(method_for_vllm("tova:budget=40"), 40, 61, None)
    assert batch_key(tova, 40, 50, None) != batch_key(h2o, 40, 50, None) != batch_key(tova, 41, 50, None)
    assert batch_key(ratio, 40, 50, None) != batch_key(ratio, 40, 61, None)
    assert batch_key(tova, 40, 50, None) != batch_key(method_for_vllm("tova:budget=41"), 40, 50, None)
    lazy = method_for_vllm("lazyeviction:budget=40:window=8")
    ts = torch.zeros(3, 3, 40, dtype=torch.int32)
    assert batch_key(lazy, 40, 50, _LazyState(3, ts, ts)) == batch_key(lazy, 40, 50, _LazyState(3, ts + 1, ts))
    assert batch_key(lazy, 40, 50, _LazyState(3, ts, ts)) != batch_key(lazy, 40, 50, _LazyState(4, ts, ts))
    assert batch_key(lazy, 40, 50, _LazyState(3, ts, ts)) != batch_key(lazy, 40, 50, _LazyState(3))
