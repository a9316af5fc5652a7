"""Slow, loop-based references for the attention-based methods, written from the specs, plus a driver
that feeds a `TrimLayer` by hand (no model) the way kvtrim's attention function does."""

from __future__ import annotations

import math

import torch

from kvtrim.attention import attend_with_probabilities
from kvtrim.cache import TrimLayer
from kvtrim.methods.base import EvictionMethod


def rand_qkv(b, hq, hkv, n, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    return q, k, v


def softmax_row(logits: list[float]) -> list[float]:
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    s = sum(e)
    return [x / s for x in e]


def attention_row(q, keys, scale) -> list[float]:
    """Softmax of one query `(d,)` over a list of keys `(d,)`, in float64."""
    return softmax_row([float((q.double() * k.double()).sum()) * scale for k in keys])


def best(scores: dict[int, float], k: int) -> list[int]:
    """The k highest-scoring entries, ties to the smaller index, returned sorted."""
    return sorted(sorted(scores, key=lambda i: (-scores[i], i))[:k])


# ---- SnapKV -----------------------------------------------------------------------------------------
def snapkv_reference(q, k, window, kernel, pooling, budget, scale):
    """Kept indices per (batch, kv head) for a one-shot prefill of all `n` positions."""
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    w = min(window, n)
    out = []
    for bi in range(b):
        heads = []
        for h in range(hkv):
            if n <= budget:
                heads.append(list(range(n)))
                continue
            m = n - window
            raw = [0.0] * m
            for qh in range(h * g, (h + 1) * g):
                for i in range(n - w, n):
                    row = attention_row(q[bi, qh, i], [k[bi, h, j] for j in range(i + 1)], scale)
                    for j in range(m):
                        raw[j] += row[j] / (g * w)
            pooled = {}
            for j in range(m):
                lo, hi = j - kernel // 2, j + kernel // 2
                vals = [raw[x] for x in range(max(0, lo), min(m, hi + 1))]
                pooled[j] = max(vals) if pooling == "max" else sum(vals) / kernel
            heads.append(best(pooled, budget - window) + list(range(m, n)))
        out.append(heads)
    return out


# ---- a hand-driven layer ------------------------------------------------------------------------------
def drive(method: EvictionMethod, q, k, v, prompt: int, scale: float, probs: bool = True):
    """Feed a `TrimLayer` a prompt of `prompt` positions, then one position per decode step.

    Returns the layer and, per step (prompt = step 0), the kept positions after the step (sorted:
    `kept_positions()`, whatever the storage order of in-place decoding).
    Decode steps hand over the probabilities that `attend_with_probabilities` used for the output.
    """
    layer = TrimLayer(method, 0)
    history = []
    layer.update(k[:, :, :prompt], v[:, :, :prompt])
    layer.after_attention(q[:, :, :prompt], None, scale)
    layer.end_prompt()  # what kvtrim.prefill declares (a standalone layer is not told)
    history.append(layer.kept_positions())
    for t in range(prompt, q.shape[2]):
        full_k, full_v = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        _, p = attend_with_probabilities(q[:, :, t : t + 1], full_k, full_v, None, scale)
        layer.after_attention(q[:, :, t : t + 1], p if probs else None, scale)
        history.append(layer.kept_positions())
    return layer, history


# ---- H2O --------------------------------------------------------------------------------------------
def h2o_reference(q, k, prompt, heavy, recent, scale):
    """Per step, per (batch, kv head): the sorted list of kept positions."""
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    steps = [[[None] * hkv for _ in range(b)] for _ in range(n - prompt + 1)]
    for bi in range(b):
        for h in range(hkv):
            stored, acc = [], {}

            def add(t):
                stored.append(t)
                acc[t] = 0.0

            def attend(i):  # query i over the stored entries (all <= i)
                for qh in range(h * g, (h + 1) * g):
                    row = attention_row(q[bi, qh, i], [k[bi, h, j] for j in stored], scale)
                    for j, p in zip(stored, row):
                        acc[j] += p

            def evict():
                nonlocal stored
                if len(stored) > heavy + recent:
                    old = stored[: len(stored) - recent]
                    stored = sorted(best({j: acc[j] for j in old}, heavy) + stored[len(stored) - recent :])

            for i in range(prompt):  # prompt: query i sees positions 0..i
                add(i)
            for i in range(prompt):
                for qh in range(h * g, (h + 1) * g):
                    row = attention_row(q[bi, qh, i], [k[bi, h, j] for j in range(i + 1)], scale)
                    for j, p in enumerate(row):
                        acc[j] += p
            evict()
            steps[0][bi][h] = list(stored)
            for s, t in enumerate(range(prompt, n), start=1):
                add(t)
                attend(t)
                evict()
                steps[s][bi][h] = list(stored)
    return steps


# ---- TOVA -------------------------------------------------------------------------------------------
def tova_reference(q, k, prompt, budget, scale):
    """Per step, per batch: the sorted list of kept positions (shared by all heads)."""
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    steps = [[None] * b for _ in range(n - prompt + 1)]
    for bi in range(b):
        stored = list(range(prompt))

        def cut(i):
            nonlocal stored
            if len(stored) <= budget:
                return
            mean = {j: 0.0 for j in stored}
            for qh in range(hq):
                row = attention_row(q[bi, qh, i], [k[bi, qh // g, j] for j in stored], scale)
                for j, p in zip(stored, row):
                    mean[j] += p / hq
            stored = best(mean, budget)

        cut(prompt - 1)
        steps[0][bi] = list(stored)
        for s, t in enumerate(range(prompt, n), start=1):
            stored.append(t)
            cut(t)
            steps[s][bi] = list(stored)
    return steps


# ---- LazyEviction -----------------------------------------------------------------------------------
def sigmoid(x):
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def lazy_score(ts, mri, t):
    h1 = 2 * sigmoid(-(1 + (t - ts) / (mri + 1e-5)))
    h2 = 0.0 if mri == 0 else 2 * sigmoid(1 - mri)
    return h1 + h2


def lazy_reference(q, k, prompt, budget, window, alpha, gqa, scale):
    """Per decode step, per (batch, kv head): kept positions, and per (batch, state head) the TS/MRI dicts."""
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    state_heads = hq if gqa == "per_query_head" else hkv
    steps = []
    stored = [[list(range(prompt)) for _ in range(hkv)] for _ in range(b)]
    ts = [[None] * state_heads for _ in range(b)]
    mri = [[None] * state_heads for _ in range(b)]
    for t, pos in enumerate(range(prompt, n), start=1):
        record = {"kept": [], "ts": [], "mri": []}
        for bi in range(b):
            for h in range(hkv):
                stored[bi][h].append(pos)
                rows = [attention_row(q[bi, qh, pos], [k[bi, h, j] for j in stored[bi][h]], scale)
                        for qh in range(h * g, (h + 1) * g)]
                sheads = list(range(h * g, (h + 1) * g)) if gqa == "per_query_head" else [h]
                for si, sh in enumerate(sheads):
                    if ts[bi][sh] is None:
                        ts[bi][sh] = {j: 0 for j in stored[bi][h]}
                        mri[bi][sh] = {j: 0 for j in stored[bi][h]}
                    else:
                        ts[bi][sh][pos] = t - 1
                        mri[bi][sh][pos] = 0
                    for idx, j in enumerate(stored[bi][h]):
                        if gqa == "per_query_head":
                            a = rows[si][idx]
                        elif gqa == "max":
                            a = max(r[idx] for r in rows)
                        else:
                            a = sum(r[idx] for r in rows) / g
                        if a >= alpha:
                            before = ts[bi][sh][j]
                            ts[bi][sh][j] = t
                            mri[bi][sh][j] = max(mri[bi][sh][j], t - before)
                if len(stored[bi][h]) > budget and t % window == 0:
                    old = stored[bi][h][: len(stored[bi][h]) - window]
                    score = {j: max(lazy_score(ts[bi][sh][j], mri[bi][sh][j], t) for sh in sheads) for j in old}
                    kept = sorted(best(score, budget - window) + stored[bi][h][-window:])
                    stored[bi][h] = kept
                    for sh in sheads:
                        ts[bi][sh] = {j: ts[bi][sh][j] for j in kept}
                        mri[bi][sh] = {j: mri[bi][sh][j] for j in kept}
        record["kept"] = [[list(stored[bi][h]) for h in range(hkv)] for bi in range(b)]
        record["ts"] = [[[ts[bi][sh][j] for j in sorted(ts[bi][sh])] for sh in range(state_heads)] for bi in range(b)]
        record["mri"] = [[[mri[bi][sh][j] for j in sorted(mri[bi][sh])] for sh in range(state_heads)] for bi in range(b)]
        steps.append(record)
    return steps
