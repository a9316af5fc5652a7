"""Where block-wise KeyDiff's eviction time goes, and whether `torch.compile` pays on this CPU (issue #15).

This script times and patches the cache internals as they were before the storage refactor (issue 26,
178e7a2: `TrimLayer._after_evict`, `kvtrim.cache.flat_rows` are gone); to reproduce its committed numbers,
run it on a checkout of 57cba0c.

    PYTHONPATH=src python benchmarks/costfloor/eviction_profile.py [--threads 1] [--out FILE.json]

1. Profile: one block-wise KeyDiff prefill (budget 1024, block 128) of a ~4k-token passkey prompt with the
   default model; each piece of the eviction (the method's hook and, inside it, the scores and the top-k;
   the cache's gather and, inside it, the row numbers and the two row copies) is wrapped with
   a wall clock and a thread CPU clock. Shares are of the whole prefill, as `kvtrim bench` reports them.
2. Repeats: in a second prefill each scoring and top-k call is repeated twice more on the same
   tensors; the first call against the repeats shows how much of the cost is the first touch after the
   model's own work (cold caches), not the arithmetic.
3. Compile: `keydiff_scores` eager against `torch.compile(dynamic=True)` and `(dynamic=False)` on one
   layer's candidates `(1, 3, 1147, 64)`: first-call (compile) time with the on-disk caches disabled,
   steady-state wall time per call (min and median of 15 batches; a quiet machine is assumed), and
   whether the scores are the same bits; then in place: the prefill of (1) with the method scoring
   through the compiled function (compiled and warmed up before), its hook time per eviction against
   the eager one.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import time

import torch

import kvtrim
import kvtrim.cache as cache_mod
import kvtrim.methods.base as base_mod
import kvtrim.methods.keydiff as keydiff_mod
from kvtrim.bench.runner import prompt_ids


def _prefill_with(model, ids, patches) -> tuple[float, float, int]:
    """One block-wise KeyDiff prefill (budget 1024, block 128) with `patches` `[(owner, attr, wrapper)]`
    applied meanwhile. Returns (wall s, thread CPU s, evictions)."""
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    for owner, attr, wrap in patches:
        setattr(owner, attr, wrap(getattr(owner, attr)))
    try:
        with torch.no_grad():
            cache = cache_mod.TrimCache(keydiff_mod.KeyDiff(budget=1024), config=model.config)
            t0, c0 = time.perf_counter(), time.thread_time()
            kvtrim.prefill(model, ids, cache, chunk_size=128)
            return time.perf_counter() - t0, time.thread_time() - c0, sum(layer.evictions for layer in cache.trim_layers())
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def profile(threads: int, length: int) -> dict:
    wall: dict[str, float] = collections.defaultdict(float)
    cpu: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def timed(name):
        def wrap(fn):
            def wrapper(*args, **kwargs):
                t0, c0 = time.perf_counter(), time.thread_time()
                out = fn(*args, **kwargs)
                wall[name] += time.perf_counter() - t0
                cpu[name] += time.thread_time() - c0
                calls[name] += 1
                return out

            return wrapper

        return wrap

    repeats: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])

    def repeated(name):
        def wrap(fn):
            def wrapper(*args, **kwargs):
                for i in range(3):
                    c0 = time.thread_time()
                    out = fn(*args, **kwargs)
                    repeats[name][i] += time.thread_time() - c0
                return out

            return wrapper

        return wrap

    model, tok = kvtrim.load_model("smollm2-135m")
    ids = prompt_ids(tok, length, 0)
    with torch.no_grad():  # warm-up (first calls), not measured
        kvtrim.prefill(model, ids[:, :512], cache_mod.TrimCache(keydiff_mod.KeyDiff(budget=256), config=model.config))
    prefill_wall, prefill_cpu, evictions = _prefill_with(model, ids, [
        (keydiff_mod.KeyDiff, "on_update", timed("hook (score + select)")),
        (keydiff_mod, "keydiff_scores", timed("  keydiff_scores")),
        (base_mod, "top_indices", timed("  top_indices")),
        (cache_mod.TrimLayer, "evict", timed("evict (gather)")),
        (cache_mod, "flat_rows", timed("  flat_rows")),
        (cache_mod, "select_rows", timed("  select_rows (keys, values)")),
    ])
    _, _, again = _prefill_with(model, ids, [(keydiff_mod, "keydiff_scores", repeated("keydiff_scores")),
                                             (base_mod, "top_indices", repeated("top_indices"))])
    pieces = {
        name: {"wall_ms": wall[name] * 1e3, "cpu_ms": cpu[name] * 1e3, "calls": calls[name],
               "wall_us_per_eviction": wall[name] / evictions * 1e6, "share_of_prefill": wall[name] / prefill_wall}
        for name in wall
    }
    first_vs_repeat = {name: {"first_cpu_us": r[0] / again * 1e6, "second_cpu_us": r[1] / again * 1e6,
                              "third_cpu_us": r[2] / again * 1e6} for name, r in repeats.items()}
    return {"prompt_tokens": int(ids.shape[-1]), "threads": threads, "evictions": evictions,
            "prefill_wall_s": prefill_wall, "prefill_cpu_s": prefill_cpu, "pieces": pieces,
            "first_call_vs_repeats": first_vs_repeat}


def _plain_scores(keys, eps=1e-12):
    """The textbook form (what torch.compile gets: it fuses it whatever the spelling)."""
    k = keys.float()
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(eps)
    anchor = unit.mean(dim=-2, keepdim=True)
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(eps)
    return -(unit * anchor).sum(dim=-1)


def compile_check(batches: int = 15, per_batch: int = 50) -> dict:
    import torch._inductor.config

    torch._inductor.config.force_disable_caches = True  # first calls compile for real (no on-disk cache)
    keys = torch.randn(1, 3, 1147, 64, generator=torch.Generator().manual_seed(0))

    def steady(fn):
        for _ in range(10):
            fn(keys)
        out = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(per_batch):
                fn(keys)
            out.append((time.perf_counter() - t0) / per_batch * 1e6)
        return {"min_us": min(out), "median_us": statistics.median(out)}

    eager = keydiff_mod.keydiff_scores
    result = {"shape": list(keys.shape), "eager": steady(eager)}
    for dynamic in (True, False):
        torch._dynamo.reset()
        compiled = torch.compile(_plain_scores, dynamic=dynamic)
        t0 = time.perf_counter()
        compiled(keys)
        first = time.perf_counter() - t0
        result[f"compiled_dynamic_{dynamic}"] = {
            "first_call_s": first, **steady(compiled),
            "same_bits_as_eager": bool(torch.equal(compiled(keys), eager(keys))),
            "max_abs_difference": float((compiled(keys) - eager(keys)).abs().max()),
        }
    return result


def compiled_in_place(length: int, dynamic: bool = True) -> dict:
    """The profile's prefill with `KeyDiff.score` going through `torch.compile(_plain_scores)`."""
    hook = {"wall": 0.0}

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            hook["wall"] += time.perf_counter() - t0
            return out

        return wrapper

    model, tok = kvtrim.load_model("smollm2-135m")
    ids = prompt_ids(tok, length, 0)
    torch._dynamo.reset()
    compiled = torch.compile(_plain_scores, dynamic=dynamic)
    original = keydiff_mod.KeyDiff.score
    keydiff_mod.KeyDiff.score = lambda self, view: compiled(view.keys)
    try:
        t0 = time.perf_counter()
        with torch.no_grad():  # compiles, and meets the shapes of a block-wise prefill (not measured)
            warm_cache = cache_mod.TrimCache(keydiff_mod.KeyDiff(budget=1024), config=model.config)
            kvtrim.prefill(model, ids[:, :1400], warm_cache)
        warm = time.perf_counter() - t0
        wall, _, evictions = _prefill_with(model, ids, [(keydiff_mod.KeyDiff, "on_update", timed)])
    finally:
        keydiff_mod.KeyDiff.score = original
    return {"dynamic": dynamic, "warm_up_prefill_s (compile included)": warm, "prefill_wall_s": wall,
            "hook_us_per_eviction": hook["wall"] / evictions * 1e6, "share_of_prefill": hook["wall"] / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/costfloor/profile.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = list(__import__("os").getloadavg())
    result = {"command": f"PYTHONPATH=src python benchmarks/costfloor/eviction_profile.py --threads {args.threads} "
                         f"--length {args.length} --out {args.out}",
              "torch": torch.__version__, "processor": platform.processor() or platform.machine(),
              "loadavg_start": load, "profile": profile(args.threads, args.length), "compile": compile_check(),
              "compiled_in_place": compiled_in_place(args.length),
              "loadavg_end": list(__import__("os").getloadavg())}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    p = result["profile"]
    print(f"prefill {p['prefill_wall_s']:.2f} s wall, {p['evictions']} evictions")
    for name, piece in p["pieces"].items():
        print(f"{name:32s} {piece['wall_us_per_eviction']:7.1f} us/eviction  "
              f"{piece['share_of_prefill'] * 100:5.2f} % of prefill")
    for name, r in p["first_call_vs_repeats"].items():
        print(f"{name.strip():16s} CPU us: first {r['first_cpu_us']:.1f}, again {r['second_cpu_us']:.1f}, "
              f"{r['third_cpu_us']:.1f}")
    print(json.dumps({"compile": result["compile"], "compiled_in_place": result["compiled_in_place"]}, indent=1))


if __name__ == "__main__":
    main()
