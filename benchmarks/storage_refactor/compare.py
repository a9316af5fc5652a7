"""Before/after comparison of two `kvtrim bench` results (the storage refactor, issue 26).

    python benchmarks/storage_refactor/compare.py before.json after.json > comparison.md

Per (method, length) cell and metric: the median over repeats before and after, their ratio, and the run's
noise for that cell: the larger of the two runs' relative spread between repeats ((max - min) / median).
A cell counts as slower only when after / before - 1 exceeds that noise.
"""

from __future__ import annotations

import json
import statistics
import sys

# time metrics (lower is better), from the raw rows; `decode_step_vs_same_size` is the decode step over a
# full cache holding as many entries, decoded in the same cell (1.0 = the physical limit)
METRICS = {
    "prefill_s": lambda r: r.get("prefill_s"),
    "decode step (untimed) s": lambda r: (r.get("decode_untimed_s") or r["decode_s"]) / r["decode_tokens"],
    "decode step vs same-size full": lambda r: ((r.get("decode_untimed_s") or r["decode_s"])
                                                / r["decode_same_size_full_s"]) if r.get("decode_same_size_full_s") else None,
}


def cells(path: str) -> dict:
    raw = json.load(open(path))["raw"]
    out: dict = {}
    for r in raw:
        if r.get("status") != "ok":
            continue
        for name, fn in METRICS.items():
            value = fn(r)
            if value is not None:
                out.setdefault((r["method"], r["length"]), {}).setdefault(name, []).append(value)
    return out


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else float("nan")


def main(before_path: str, after_path: str) -> int:
    before, after = cells(before_path), cells(after_path)
    print(f"before: `{before_path}`, after: `{after_path}` (medians over repeats; noise = the larger relative "
          "spread between repeats of the two runs)\n")
    print("| method | length | metric | before | after | after/before | noise | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    slower = 0
    for key in before:
        if key not in after:
            continue
        for name in METRICS:
            b, a = before[key].get(name), after[key].get(name)
            if not b or not a:
                continue
            mb, ma = statistics.median(b), statistics.median(a)
            noise = max(spread(b), spread(a))
            ratio = ma / mb
            verdict = "within noise" if abs(ratio - 1) <= noise else "slower" if ratio > 1 else "faster"
            slower += verdict == "slower"
            print(f"| {key[0]} | {key[1]} | {name} | {mb:.4g} | {ma:.4g} | {ratio:.3f} | {noise:.3f} | {verdict} |")
    print(f"\ncells slower beyond the noise: {slower}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
