"""The cache layer's own cost per decode step, without a model: `TrimLayer.update` (+ the attention
hand-off for methods that take probabilities) on synthetic SmolLM2-135M-shaped entries (batch 1, 3 KV
heads, 9 query heads, head_dim 64, float32), 1024 prompt entries, then decode steps.

    PYTHONPATH=<checkout>/src python benchmarks/storage_refactor/layer_overhead.py OUT.json

Run it for the code before and after a change, back to back under the CPU lock (kvtrim bench's
end-to-end cells are dominated by the model's own work, whose run-to-run noise on a shared machine is
10-60 %; this isolates what the storage refactor touched). Reports the median over rounds of the mean
microseconds per step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import kvtrim
from kvtrim.cache import TrimLayer

B, H, Q_HEADS, D, PROMPT, STEPS, ROUNDS = 1, 3, 9, 64, 1024, 400, 7
METHODS = {
    "full": lambda: kvtrim.FullCache(),
    "streaming (in place)": lambda: kvtrim.StreamingLLM(budget=256),
    "h2o (in place)": lambda: kvtrim.H2O(budget=256),
    "tova (in place)": lambda: kvtrim.TOVA(budget=256),
    "keydiff (block evictions)": lambda: kvtrim.KeyDiff(budget=256, block_size=16),
}


def run(make, steps: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    layer = TrimLayer(make(), 0)
    k, v = torch.randn(B, H, PROMPT, D, generator=g), torch.randn(B, H, PROMPT, D, generator=g)
    layer.update(k, v)
    if layer.awaiting_attention:
        layer.after_attention(torch.randn(B, Q_HEADS, PROMPT, D, generator=g), None, D**-0.5)
    keys = torch.randn(steps, B, H, 1, D, generator=g)
    queries = torch.randn(steps, B, Q_HEADS, 1, D, generator=g)
    t0 = time.perf_counter()
    for i in range(steps):
        layer.update(keys[i], keys[i])
        if layer.awaiting_attention:
            n = layer.stored
            probs = torch.softmax(torch.randn(B, Q_HEADS, 1, n, generator=g), dim=-1)
            layer.after_attention(queries[i], probs if layer.method.needs_attention else None, D**-0.5)
    return (time.perf_counter() - t0) / steps * 1e6


def main(out: str) -> int:
    torch.set_num_threads(1)
    result = {"shape": dict(batch=B, kv_heads=H, q_heads=Q_HEADS, head_dim=D, prompt=PROMPT, steps=STEPS),
              "rounds": ROUNDS, "cache_py": kvtrim.cache.__file__, "us_per_step": {}}
    for name, make in METHODS.items():
        run(make, 50, 0)  # warm-up
        times = [run(make, STEPS, r) for r in range(ROUNDS)]
        result["us_per_step"][name] = {"median": statistics.median(times), "all": times}
        print(f"{name}: {statistics.median(times):.1f} us/step (min {min(times):.1f}, max {max(times):.1f})")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
