"""Where H2O's per-step choice goes, operation by operation (issue #15, item 2, second pass).

    PYTHONPATH=src python benchmarks/costfloor/h2o_ops.py [--threads 2] [--length 2048] [--out FILE.json]

A passkey prompt of `--length` tokens (default model, float32) is prefilled with H2O at `--budget`
entries per layer and KV head (default 509: what `--compression-ratio 0.75` gives at 2037 tokens), then
`--steps` greedy decode steps run in place. H2O's `lowest_slot` is replaced, for the measurement only,
by a copy of its ranked-window form (a `kthvalue` over the positions, which `last_from` now skips) with a
clock after each operation: microseconds per layer and step, median over `--rounds` rounds.

Then, on one layer's shapes (`(1, 3, budget, 64)` keys, 9 query heads), the logits of the probability
path: `matmul` on 4-D tensors against `bmm` on `(batch * kv_heads)` matrices (the same bits), each call
after 32 MB of other memory traffic, the two forms alternating, median of 300.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import kvtrim
import kvtrim.methods.h2o as h2o_module
from kvtrim.bench.runner import prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_profile import Clocks, build, steps  # noqa: E402

OPS = ("kthvalue", "compare (window)", "fill (window)", "amin", "compare (lowest)", "fill (positions)", "argmax")


def timed_lowest_slot(seconds: dict, calls: list):
    clock = time.perf_counter

    def lowest_slot(scores, positions, first=0, last=0, last_from=None):
        assert not first and last, "H2O protects only its recent window"
        n = positions.shape[-1]
        t = [clock()]
        threshold = positions.kthvalue(n - last, dim=-1, keepdim=True).values
        t.append(clock())
        newest = positions > threshold
        t.append(clock())
        masked = scores.float().masked_fill(newest, torch.inf)
        t.append(clock())
        low = masked.amin(dim=-1, keepdim=True)
        t.append(clock())
        other = masked != low
        t.append(clock())
        latest = positions.masked_fill(other, -1)
        t.append(clock())
        slot = latest.argmax(dim=-1)
        t.append(clock())
        for name, a, b in zip(OPS, t, t[1:]):
            seconds[name] += b - a
        calls[0] += 1
        return slot

    return lowest_slot


def logits_us(budget: int, calls: int) -> dict:
    q = torch.randn(1, 9, 1, 64)
    k = torch.randn(1, 3, budget, 64)
    junk = torch.randn(8_000_000)
    forms = {
        "matmul (4-D)": lambda: torch.matmul(q.reshape(1, 3, 3, 64), k.transpose(-1, -2)),
        "bmm": lambda: torch.bmm(q.reshape(3, 3, 64), k.reshape(3, budget, 64).transpose(1, 2)),
    }
    assert torch.equal(forms["matmul (4-D)"]().reshape(3, 3, budget), forms["bmm"]())
    times = {name: [] for name in forms}
    for _ in range(calls):  # the two forms alternate, so drifts of the machine hit both alike
        for name, fn in forms.items():
            junk.add_(1.0)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=509)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvtrim.load_model("smollm2-135m", dtype=torch.float32)
    ids = prompt_ids(tokenizer, args.length)
    original = h2o_module.lowest_slot
    rounds = []
    try:
        for _ in range(args.rounds):
            seconds, calls = collections.defaultdict(float), [0]
            cache, logits = build(model, ids, "h2o", True, args.budget)
            steps(model, cache, logits, 3, Clocks())  # into the steady state, untimed
            h2o_module.lowest_slot = timed_lowest_slot(seconds, calls)
            steps(model, cache, logits, args.steps, Clocks())
            h2o_module.lowest_slot = original
            rounds.append({name: seconds[name] / calls[0] * 1e6 for name in OPS})
    finally:
        h2o_module.lowest_slot = original
    per_op = {name: statistics.median(r[name] for r in rounds) for name in OPS}
    result = {"prompt_tokens": ids.shape[-1], "budget": args.budget, "threads": args.threads, "steps": args.steps,
              "torch": torch.__version__, "machine": platform.machine(), "lowest_slot_us": per_op,
              "lowest_slot_rounds": rounds, "logits_us": logits_us(args.budget, 300)}
    print(", ".join(f"{k} {v:.1f}" for k, v in per_op.items()), "| total", f"{sum(per_op.values()):.1f} us")
    print("logits:", ", ".join(f"{k} {v:.1f} us" for k, v in result["logits_us"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
