"""Decode-step cost of ragged cache layers in `TrimCache` (issue #11), on the default model, CPU.

Three caches after the same compressed prompt, decoded the same greedy steps, interleaved (A B C A B C ...):

* `dense`: KNorm(compression_ratio=r): every head keeps `budget` entries, dense tensors, stock SDPA path;
* `ragged_equal`: the very same entries moved into ragged storage (`RaggedKV.from_dense`): equal lengths,
  the ragged path (padded view + masked SDPA) — the price of the path itself;
* `adakv`: AdaKV(KNorm(compression_ratio=r)): the same total entries per layer, unequal head lengths.

Reports the median decode-step time of each, the median of the per-repeat ratios to `dense`, and the
allocated vs ideal KV bytes measured from the tensors (`cache.stats()`).

    OMP_NUM_THREADS=1 python benchmarks/ragged/decode_cost.py --out benchmarks/ragged/decode_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvtrim
from kvtrim.storage import RaggedKV


def to_ragged(cache: kvtrim.TrimCache) -> None:
    for layer in cache.trim_layers():
        layer.storage = RaggedKV.from_dense(layer.keys, layer.values, layer.positions)
        layer.keys = layer.values = layer.positions = None


def step_times(model, cache, first_token, steps: int) -> list[float]:
    token, times = first_token, []
    with torch.no_grad():
        for _ in range(steps):
            t0 = time.perf_counter()
            logits = model(token, cache=cache).logits[:, -1]
            times.append(time.perf_counter() - t0)
            token = logits.argmax(-1, keepdim=True)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = kvtrim.load_model("smollm2-135m")
    ids = torch.randint(100, 40000, (1, args.length), generator=torch.Generator().manual_seed(0))
    ctx = {
        "dense": kvtrim.compress(model, ids, kvtrim.KNorm(compression_ratio=args.ratio)),
        "adakv": kvtrim.compress(model, ids, kvtrim.AdaKV(kvtrim.KNorm(compression_ratio=args.ratio))),
    }
    ctx["ragged_equal"] = kvtrim.compress(model, ids, kvtrim.KNorm(compression_ratio=args.ratio))
    first = ctx["dense"].logits.argmax(-1, keepdim=True)
    medians: dict[str, list[float]] = {k: [] for k in ("dense", "ragged_equal", "adakv")}
    stats = {}
    for _ in range(args.repeats):
        for name in medians:
            cache = ctx[name].new_cache()
            if name == "ragged_equal":
                to_ragged(cache)
            medians[name].append(statistics.median(step_times(model, cache, first, args.steps)))
            s = cache.stats()
            stats[name] = {"bytes_allocated": s.bytes_allocated, "bytes_ideal": s.bytes_ideal,
                           "ragged_layers": len(s.ragged_layers),
                           "head_lengths_layer0": s.lengths_per_layer[0][0]}
    result = {
        "command": "OMP_NUM_THREADS=1 python benchmarks/ragged/decode_cost.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": "smollm2-135m", "device": "cpu", "threads": 1, "dtype": "float32", **vars(args),
        "decode_step_median_s": {k: statistics.median(v) for k, v in medians.items()},
        "ratio_to_dense_median": {k: statistics.median(a / d for a, d in zip(v, medians["dense"]))
                                  for k, v in medians.items()},
        "per_repeat_s": medians,
        "memory_after_decoding": stats,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("decode_step_median_s", "ratio_to_dense_median")}, indent=1))
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
