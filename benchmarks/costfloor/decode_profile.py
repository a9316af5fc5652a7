"""Where a decode step of a step-wise evicting method spends its time above a full cache of the same size
(issue #15, item 2).

    PYTHONPATH=src python benchmarks/costfloor/decode_profile.py [--threads 2] [--length 1024] [--out FILE.json]

A passkey prompt of `--length` tokens (default model, float32) is prefilled once per method with a budget
of `--budget` entries per layer and KV head (default 1000: ~1k entries, one leaving per step), then `--steps` greedy decode steps are
timed, interleaved with the same steps on a full cache holding the same number of entries per layer
(`same_size_full_cache`, the bench's physical limit) — the in-place path, and the copying path
(`TrimCache(in_place_decode=False)`). Per step (median over `--repeats` rounds): the whole step, and,
from wall clocks wrapped around kvtrim functions only, the layer's `update` (append or write into the
free slot), the attention call (SDPA, or the explicit probability path of methods that need the
probabilities), the hand-off (`after_attention`: the method's hook and the eviction) and, inside it,
the method's hook.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time

import torch

import kvtrim
import kvtrim.attention as attention_mod
import kvtrim.cache as cache_mod
from kvtrim.bench.runner import prompt_ids, same_size_full_cache, stored_shapes
from kvtrim.specs import parse_method_spec

METHODS = ("h2o", "tova", "streaming")


class Clocks:
    """Wall clocks around named callables (attributes of kvtrim modules or classes), summed per name."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.on = False
        self._originals = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)
        self._originals.append((owner, attr, fn))

        def wrapper(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        setattr(owner, attr, wrapper)

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._originals):
            setattr(owner, attr, fn)

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), collections.defaultdict(float)
        return out


def build(model, ids, name: str, in_place: bool, budget: int):
    """A cache prefilled with `ids` by method `name` at `budget`, and the last logits `(1, vocab)`."""
    method = parse_method_spec(f"{name}:budget={budget}").build(ids.shape[-1], 0.75)
    cache = kvtrim.TrimCache(method, config=model.config, in_place_decode=in_place)
    with torch.no_grad():
        return cache, kvtrim.prefill(model, ids, cache)


@torch.no_grad()
def steps(model, cache, logits, n: int, clocks: Clocks) -> tuple[float, dict[str, float]]:
    token = logits.argmax(-1, keepdim=True)
    clocks.take()
    clocks.on = True
    t0 = time.perf_counter()
    for _ in range(n):
        pos = cache.get_seq_length()
        out = model(input_ids=token, cache=cache, position_ids=torch.tensor([[pos]]), use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    wall = time.perf_counter() - t0
    clocks.on = False
    return wall / n, {k: v / n for k, v in clocks.take().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvtrim.load_model("smollm2-135m", dtype=torch.float32)
    ids = prompt_ids(tokenizer, args.length)
    clocks = Clocks()
    clocks.wrap(cache_mod.TrimLayer, "update", "update")
    clocks.wrap(cache_mod.TrimLayer, "after_attention", "hand-off")
    clocks.wrap(attention_mod, "attend_with_probabilities", "attention")
    clocks.wrap(attention_mod, "sdpa_attention_forward", "attention")
    rows = collections.defaultdict(list)
    try:
        for _ in range(args.repeats):
            for name in METHODS:
                for in_place in (True, False):
                    cache, logits = build(model, ids, name, in_place, args.budget)
                    hook_name = "on_attention" if cache.method.waits_for_attention else "on_update"
                    clocks.wrap(cache.method, hook_name, "method hook")  # an instance attribute, removed below
                    shapes = stored_shapes(cache)
                    steps(model, cache, logits, 3, clocks)  # into the steady state (the first step appends)
                    step, parts = steps(model, cache, logits, args.steps, clocks)
                    clocks._originals.pop()
                    del cache.method.__dict__[hook_name]
                    full = same_size_full_cache(model, shapes)
                    steps(model, full, logits, 3, clocks)
                    full_step, full_parts = steps(model, full, logits, args.steps, clocks)
                    key = f"{name} {'in place' if in_place else 'copying'}"
                    rows[key].append({"step": step, "full_step": full_step, "ratio": step / full_step,
                                      **{f"{k} ms": v * 1000 for k, v in parts.items()},
                                      **{f"full {k} ms": v * 1000 for k, v in full_parts.items()},
                                      "entries": max(s[0].shape[-2] for s in shapes.values())})
    finally:
        clocks.restore()
    summary = {}
    for key, runs in rows.items():
        summary[key] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        s = summary[key]
        print(f"{key:22s} step {s['step'] * 1000:6.2f} ms, same-size full {s['full_step'] * 1000:6.2f} ms, "
              f"ratio {s['ratio']:.3f} | " + ", ".join(f"{k} {v:.2f}" for k, v in s.items() if k.endswith("ms")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "platform": platform.platform(),
                       "loadavg": list(os.getloadavg()), "rows": rows, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
