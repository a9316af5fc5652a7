"""KeyDiff's whole block-eviction decision under `torch.compile` against eager (issue #15, item 1).

    PYTHONPATH=src python benchmarks/costfloor/compile_decision.py [--threads 2] [--out FILE.json]

The decision is what one eviction of block-wise KeyDiff computes at SmolLM2's layer shape (budget 1024,
block 128: `(1, 3, 1152, 64)` candidates): the scores, the `kthvalue` threshold and the kept mask, compiled
as one graph with static shapes (at budget the candidate count is the same at every block, so nothing
recompiles), once with inductor's default Python wrapper and once with its C++ wrapper. Eager is main's
`top_indices(keydiff_scores(keys), 1024)`. Per call, median of `--calls`: "warm" right after the previous
call; "cold" after 16 MB of other memory traffic (what the model's own work does between two evictions).
The compiled mask is also turned into indices (`nonzero`) as the hook would need, and the kept sets are
compared with eager's on fresh random keys.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from kvtrim.methods.base import top_indices
from kvtrim.methods.keydiff import keydiff_scores

SHAPE = (1, 3, 1152, 64)
KEEP = 1024


def decision(keys: torch.Tensor) -> torch.Tensor:
    """`keydiff_scores` + `_top_without_ties`' threshold, written out-of-place for the compiler: the kept mask."""
    unit = keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    anchor = unit.mean(dim=-2, keepdim=True)
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-12).neg()
    scores = (unit * anchor).sum(-1)
    threshold = scores.kthvalue(SHAPE[2] - KEEP, dim=-1, keepdim=True).values
    return scores > threshold


def per_call_us(fn, calls: int, cold: bool, junk: torch.Tensor) -> float:
    times = []
    for _ in range(calls):
        keys = torch.randn(SHAPE)
        if cold:
            junk.mul_(1.0001)
        t0 = time.perf_counter()
        fn(keys)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--agree", type=int, default=300, help="random inputs on which the kept sets are compared")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    junk = torch.randn(4_000_000)
    b, h = SHAPE[:2]

    def eager(keys):
        return top_indices(keydiff_scores(keys), KEEP)

    result = {"shape": SHAPE, "keep": KEEP, "threads": args.threads, "torch": torch.__version__,
              "machine": platform.machine(), "arms": {}}
    for label, options in (("compiled", {}), ("compiled, cpp_wrapper", {"cpp_wrapper": True})):
        torch._dynamo.reset()
        compiled = torch.compile(decision, dynamic=False, options=options)
        t0 = time.perf_counter()
        compiled(torch.randn(SHAPE))
        first_call_s = time.perf_counter() - t0

        def as_indices(keys, compiled=compiled):
            return compiled(keys).nonzero()[:, -1].view(b, h, KEEP)

        disagree = sum(not torch.equal(eager(k), as_indices(k)) for k in (torch.randn(SHAPE) for _ in range(args.agree)))
        row = {"first_call_s": first_call_s, "kept_sets_differ": disagree, "of": args.agree}
        for cold in (False, True):
            tag = "cold" if cold else "warm"
            row[f"eager_us_{tag}"] = per_call_us(eager, args.calls, cold, junk)
            row[f"compiled_mask_us_{tag}"] = per_call_us(compiled, args.calls, cold, junk)
            row[f"compiled_indices_us_{tag}"] = per_call_us(as_indices, args.calls, cold, junk)
        result["arms"][label] = row
        print(label, {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
