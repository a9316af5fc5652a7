"""What `kvtrim bench`'s eviction timer costs a decode step (issue #15, item 3).

    PYTHONPATH=src python benchmarks/costfloor/timer_overhead.py [--threads 2] [--rounds 4] [--out FILE.json]

The bench times a method's hooks and gathers by wrapping them (`kvtrim.bench.timing.EvictionTimer`).
For methods that run hooks at every decode step (H2O, TOVA) the wrappers are part of every step. Here,
per method and prompt length (default model, float32, `--compression-ratio 0.75`), each round prefills
the prompt into a cache with the timer (as the bench does) and one without, decodes `--tokens` greedy
tokens from each, then decodes a full cache of the method's stored size (the bench's physical limit):
medians over the rounds of timed / untimed, timed / full and untimed / full.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import kvtrim
from kvtrim.bench.runner import decode, prompt_ids, same_size_full_cache, stored_shapes
from kvtrim.bench.timing import EvictionTimer
from kvtrim.prefill import prefill
from kvtrim.specs import parse_method_spec


@torch.no_grad()
def decode_seconds(model, ids, name: str, ratio: float, tokens: int, timed: bool):
    """Seconds to decode `tokens` after prefilling `ids` with method `name`, and the cache's stored shapes."""
    method = parse_method_spec(name).build(ids.shape[-1], ratio)
    timer = EvictionTimer("cpu")
    cache = kvtrim.TrimCache(timer.instrument(method) if timed else method, config=model.config)
    if timed:
        timer.attach(cache)
    logits = prefill(model, ids, cache)
    shapes = stored_shapes(cache)
    t0 = time.perf_counter()
    decode(model, cache, logits, tokens)
    seconds = time.perf_counter() - t0
    timer.detach()
    return seconds, shapes, logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--methods", default="h2o,tova")
    parser.add_argument("--compression-ratio", type=float, default=0.75)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvtrim.load_model("smollm2-135m", dtype=torch.float32)
    out = {"threads": args.threads, "rounds": args.rounds, "tokens": args.tokens, "torch": torch.__version__,
           "machine": platform.machine(), "cells": []}
    for length in (int(x) for x in args.lengths.split(",")):
        ids = prompt_ids(tokenizer, length)
        for name in args.methods.split(","):
            runs = {"timed": [], "untimed": [], "full": []}
            for _ in range(args.rounds):
                for arm in ("timed", "untimed"):
                    seconds, shapes, logits = decode_seconds(model, ids, name, args.compression_ratio, args.tokens,
                                                             timed=arm == "timed")
                    runs[arm].append(seconds)
                full = same_size_full_cache(model, shapes)
                t0 = time.perf_counter()
                with torch.no_grad():
                    decode(model, full, logits, args.tokens)
                runs["full"].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in runs.items()}
            cell = {"method": name, "prompt_tokens": ids.shape[-1], "seconds": runs,
                    "timed_vs_untimed": med["timed"] / med["untimed"], "timed_vs_full": med["timed"] / med["full"],
                    "untimed_vs_full": med["untimed"] / med["full"]}
            out["cells"].append(cell)
            print(f"{name} @ {ids.shape[-1]}: timed/untimed {cell['timed_vs_untimed']:.3f}, timed/full "
                  f"{cell['timed_vs_full']:.3f}, untimed/full {cell['untimed_vs_full']:.3f}", flush=True)
            if args.out:  # written as cells finish
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
