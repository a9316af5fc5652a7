"""Block-wise KeyDiff's eviction share of a 4k prefill: main's code against candidate rewrites, in one
process, interleaved (issue #15, item 1), and where the time of one eviction goes, operation by operation.

This script times and patches the cache internals as they were before the storage refactor (issue 26,
178e7a2: `TrimLayer._after_evict`, `kvtrim.cache.flat_rows` are gone); to reproduce its committed numbers,
run it on a checkout of 57cba0c.

    PYTHONPATH=src python benchmarks/costfloor/ab_prefill.py [--threads 2] [--rounds 3] [--out FILE.json]

1. A/B: `rounds` rounds of block-wise prefills (budget 1024, block 128, the default model, a ~4k-token
   passkey prompt), one per arm, the order reversed every other round. Arms: "main" (the code as it is)
   and the candidates, patched in from here (`--arms`): `top_indices` reading the kept entries with
   `masked_select` of a cached `arange` (one operation fewer than `nonzero` + column slice),
   `keydiff_scores` taking product and sum in one `linalg.vecdot` call (same kernels, same bits), and
   the method's hook run on one thread (`torch.set_num_threads(1)` around it, its own cost included).
   Eviction time is measured by the bench's own `EvictionTimer` (the method's hooks + the cache's
   gather); the kept positions of every layer are compared with main's.
2. Lines: one more prefill (main's code) with each operation of an eviction timed alone (wall clock
   around each statement; the gather as `TrimLayer.evict` does it), per eviction.
3. Stacked (idea: one scoring + top-k over every layer's keys at once instead of 30 small calls): on
   random keys of the prefill's shape (30 layers of `(1, 3, 1147, 64)`), the scores and kept indices of
   all layers by one call on a stacked `(30, 3, 1147, 64)` tensor (stacking copy included, and without
   it: keys already in one buffer) against 30 per-layer calls. Before each layer's call ~18 MB (one
   layer's weights) are read, before the stacked call 30 times that, as the model's own work would.

A machine shared with other work drifts by more than these changes between runs minutes apart; the
interleaved rounds and the paired medians are what make the comparison.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import statistics
import time

import torch

import kvtrim
import kvtrim.cache as cache_mod
import kvtrim.methods.base as base_mod
import kvtrim.methods.keydiff as keydiff_mod
from kvtrim.bench.runner import prompt_ids
from kvtrim.bench.timing import EvictionTimer


# ---- candidate rewrites (same bits, same kept sets) -----------------------------------------------------
@functools.lru_cache(maxsize=16)
def _entry_numbers(n: int) -> torch.Tensor:
    return torch.arange(n)


def top_indices_masked(scores, k):
    """main's `top_indices` on CPU with `masked_select` of a cached arange instead of `nonzero` + slice."""
    n = scores.shape[-1]
    if k >= n:
        return torch.arange(n).expand_as(scores)
    threshold = scores.kthvalue(n - k, dim=-1, keepdim=True).values
    above = torch.masked_select(_entry_numbers(n), scores > threshold)
    if above.shape[0] != scores.numel() // n * k:
        return base_mod._top_by_sort(scores, k) if n < 1024 else base_mod._top_by_threshold(scores, k)
    return above.view(*scores.shape[:-1], k)


def keydiff_scores_vecdot(keys, eps=1e-12):
    """main's `keydiff_scores` with product and sum in one `linalg.vecdot` call (same bits)."""
    k = keys if keys.dtype == torch.float32 else keys.float()
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min_(eps)
    anchor = unit.mean(dim=-2, keepdim=True)
    anchor = anchor.div_(anchor.norm(dim=-1, keepdim=True).clamp_min_(eps).neg_())
    return torch.linalg.vecdot(unit, anchor)


def _hook_on_one_thread(hook):
    """`hook` run with one torch thread (idea: small-tensor operations on two threads can be slower)."""

    def wrapper(self, view):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return hook(self, view)
        finally:
            torch.set_num_threads(threads)

    return wrapper


ARMS = {
    "main": [],
    "masked_select top-k": [(base_mod, "top_indices", top_indices_masked)],
    "vecdot scores": [(keydiff_mod, "keydiff_scores", keydiff_scores_vecdot)],
    "hook on 1 thread": [(keydiff_mod.KeyDiff, "on_update", _hook_on_one_thread(keydiff_mod.KeyDiff.on_update))],
}


def run_prefill(model, ids, patches=(), budget: int = 1024) -> dict:
    """One block-wise KeyDiff prefill with `patches` `[(module, name, fn)]` in place; the bench's timer."""
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, fn in patches:
        setattr(owner, attr, fn)
    try:
        timer = EvictionTimer()
        method = timer.instrument(keydiff_mod.KeyDiff(budget=budget))
        cache = timer.attach(cache_mod.TrimCache(method, config=model.config))
        t0 = time.perf_counter()
        with torch.no_grad():
            kvtrim.prefill(model, ids, cache, chunk_size=128)
        wall = time.perf_counter() - t0
        totals = timer.totals()
        timer.detach()
        evictions = sum(layer.evictions for layer in cache.trim_layers())
        return {"prefill_s": wall, "evict_s": totals["prefill_evict_s"], "score_s": totals["prefill_score_s"],
                "gather_s": totals["prefill_gather_s"], "evictions": evictions,
                "positions": [layer.positions.clone() for layer in cache.trim_layers()]}
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


# ---- operation by operation --------------------------------------------------------------------------------
LINES: dict[str, float] = collections.defaultdict(float)


def _clock(name: str, t0: float) -> float:
    t1 = time.perf_counter()
    LINES[name] += t1 - t0
    return t1


def keydiff_scores_lines(keys, eps=1e-12):
    t = time.perf_counter()
    k = keys if keys.dtype == torch.float32 else keys.float()
    norm = k.norm(dim=-1, keepdim=True)
    t = _clock("score: norm of the keys", t)
    norm = norm.clamp_min_(eps)
    t = _clock("score: clamp (tiny)", t)
    unit = k / norm
    t = _clock("score: divide (unit keys)", t)
    anchor = unit.mean(dim=-2, keepdim=True)
    t = _clock("score: mean (anchor)", t)
    scale = anchor.norm(dim=-1, keepdim=True).clamp_min_(eps).neg_()
    anchor = anchor.div_(scale)
    t = _clock("score: anchor norm, clamp, negate, divide (4 tiny)", t)
    prod = unit.mul_(anchor)
    t = _clock("score: multiply (in place)", t)
    scores = prod.sum(dim=-1)
    _clock("score: sum", t)
    return scores


def top_indices_lines(scores, k):
    n = scores.shape[-1]
    if k >= n:
        return torch.arange(n, device=scores.device).expand_as(scores)
    t = time.perf_counter()
    threshold = scores.kthvalue(n - k, dim=-1, keepdim=True).values
    t = _clock("select: kthvalue", t)
    above = scores > threshold
    t = _clock("select: compare (tiny)", t)
    found = above.nonzero()
    t = _clock("select: nonzero", t)
    if found.shape[0] != scores.numel() // n * k:
        return base_mod._top_by_threshold(scores, k)
    out = found[:, -1].view(*scores.shape[:-1], k)
    _clock("select: column slice + view (+ count check)", t)
    return out


def evict_lines(self, keep):
    if keep is None:
        return
    t = time.perf_counter()
    b, h, n = self.positions.shape
    assert not (keep.dtype == torch.bool or (keep.numel() > 0 and int(keep.min()) < 0))
    t = _clock("gather: check of the kept indices (min)", t)
    rows = cache_mod.flat_rows(keep, self.keys.shape[2])
    t = _clock("gather: flat row numbers", t)
    self.keys = cache_mod.select_rows(self.keys, rows, keep.shape[-1])
    t = _clock("gather: key rows", t)
    self.values = cache_mod.select_rows(self.values, rows, keep.shape[-1])
    t = _clock("gather: value rows", t)
    self.positions = self.positions.gather(2, keep)
    t = _clock("gather: positions", t)
    self._after_evict(keep)
    _clock("gather: method state", t)


LINE_PATCHES = [(keydiff_mod, "keydiff_scores", keydiff_scores_lines), (base_mod, "top_indices", top_indices_lines),
                (cache_mod.TrimLayer, "evict", evict_lines)]


def stacked_vs_per_layer(repeats: int = 5, layers: int = 30) -> dict:
    """Seconds per block: 30 per-layer KeyDiff selections against one stacked one (see the docstring)."""
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 3, 1147, 64, generator=g) for _ in range(layers)]
    weights = torch.randn(layers, 18 * 2**20 // 4, generator=g)  # stands for the model's weights

    def per_layer():
        total = 0.0
        for i, k in enumerate(keys):
            weights[i].sum()
            t0 = time.perf_counter()
            base_mod.top_indices(keydiff_mod.keydiff_scores(k), 1019)
            total += time.perf_counter() - t0
        return total

    buffer = torch.stack(keys).squeeze(1)

    def stacked(copy: bool):
        weights.sum()
        t0 = time.perf_counter()
        x = torch.stack(keys).squeeze(1) if copy else buffer
        base_mod.top_indices(keydiff_mod.keydiff_scores(x), 1019)
        return time.perf_counter() - t0

    same = torch.equal(keydiff_mod.keydiff_scores(buffer),
                       torch.cat([keydiff_mod.keydiff_scores(k) for k in keys]))
    out = {"per_layer_s": [], "stacked_with_copy_s": [], "stacked_in_one_buffer_s": []}
    for _ in range(repeats):
        out["per_layer_s"].append(per_layer())
        out["stacked_with_copy_s"].append(stacked(True))
        out["stacked_in_one_buffer_s"].append(stacked(False))
    summary = {k + "_median": statistics.median(v) for k, v in out.items()}
    return {**out, **summary, "stacked_scores_same_bits": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from: {', '.join(ARMS)}")
    parser.add_argument("--out", default="benchmarks/costfloor/ab_prefill.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = list(os.getloadavg())
    model, tok = kvtrim.load_model("smollm2-135m")
    ids = prompt_ids(tok, args.length, 0)
    with torch.no_grad():  # warm-up (first calls), not measured
        kvtrim.prefill(model, ids[:, :512], cache_mod.TrimCache(keydiff_mod.KeyDiff(budget=256), config=model.config))
    arms = args.arms.split(",")
    runs = {name: [] for name in arms}
    same = True
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        got = {}
        for name in order:
            got[name] = run_prefill(model, ids, ARMS[name])
            row = {k: v for k, v in got[name].items() if k != "positions"}
            row["share"] = row["evict_s"] / row["prefill_s"]
            runs[name].append(row)
            print(f"round {r} {name:20s} prefill {row['prefill_s']:.2f} s, eviction {row['evict_s'] * 1e3:.0f} ms "
                  f"({row['share'] * 100:.2f} %), {row['evict_s'] / row['evictions'] * 1e6:.0f} us/eviction", flush=True)
        same &= all(all(torch.equal(a, b) for a, b in zip(got[arms[0]]["positions"], got[name]["positions"]))
                    for name in arms)
    LINES.clear()
    lines_run = run_prefill(model, ids, LINE_PATCHES)
    per_eviction = {name: s / lines_run["evictions"] * 1e6 for name, s in LINES.items()}
    stacked = stacked_vs_per_layer()

    def median(name, key):
        return statistics.median(row[key] for row in runs[name])

    summary = {name: {"share_median": median(name, "share"), "prefill_s_median": median(name, "prefill_s"),
                      "evict_us_per_eviction_median": statistics.median(
                          row["evict_s"] / row["evictions"] * 1e6 for row in runs[name]),
                      "score_us_per_eviction_median": statistics.median(
                          row["score_s"] / row["evictions"] * 1e6 for row in runs[name]),
                      "gather_us_per_eviction_median": statistics.median(
                          row["gather_s"] / row["evictions"] * 1e6 for row in runs[name])}
               for name in runs}
    paired = {name: [c["evict_s"] / p["evict_s"] for p, c in zip(runs[arms[0]], runs[name])] for name in arms[1:]}
    result = {
        "command": f"PYTHONPATH=src python benchmarks/costfloor/ab_prefill.py --threads {args.threads} "
                   f"--length {args.length} --rounds {args.rounds} --arms '{args.arms}' --out {args.out}",
        "torch": torch.__version__, "processor": platform.processor() or platform.machine(),
        "prompt_tokens": int(ids.shape[-1]), "loadavg_start": load_start, "runs": runs, "summary": summary,
        "eviction_time_over_first_arm_per_round": paired, "same_kept_positions": same,
        "lines_us_per_eviction": per_eviction, "lines_prefill_s": lines_run["prefill_s"],
        "lines_evictions": lines_run["evictions"], "stacked_vs_per_layer": stacked,
        "loadavg_end": list(os.getloadavg()),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))
    print("eviction time / first arm's, per round:", {k: [round(x, 3) for x in v] for k, v in paired.items()},
          "same kept positions:", same)
    for name, us in per_eviction.items():
        print(f"{name:55s} {us:7.1f} us")
    print("stacked vs per layer (s per block):", {k: v for k, v in stacked.items() if not isinstance(v, list)})


if __name__ == "__main__":
    main()
