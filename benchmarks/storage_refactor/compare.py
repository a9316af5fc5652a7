"""Before/after comparison of two `kvtrim bench` results (the storage refactor, issue 26).

    python benchmarks/storage_refactor/compare.py before*.json -- after*.json > comparison.md

Each side is one or more `kvtrim bench` results (their repeats are pooled). Per (method, length) cell and
metric: the median over repeats before and after, their ratio, and the noise for that cell: the larger of
the two sides' relative spread between repeats ((max - min) / median). A cell counts as slower only when
after / before - 1 exceeds that noise.
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


def cells(paths: list[str]) -> dict:
    raw = [r for path in paths for r in json.load(open(path))["raw"]]
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


def main(argv: list[str]) -> int:
    split = argv.index("--")
    before_paths, after_paths = argv[:split], argv[split + 1 :]
    before, after = cells(before_paths), cells(after_paths)
    print(f"before: {', '.join(before_paths)}; after: {', '.join(after_paths)} (medians over the pooled "
          "repeats; noise = the larger relative spread between repeats of the two sides)\n")
    print("| method | length | metric | before (repeats) | after (repeats) | after/before | noise | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    slower, ratios = 0, {}
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
            ratios.setdefault(name, []).append(ratio)
            print(f"| {key[0]} | {key[1]} | {name} | {mb:.4g} ({len(b)}) | {ma:.4g} ({len(a)}) | {ratio:.3f} | {noise:.3f} | {verdict} |")
    print(f"\ncells slower beyond the noise: {slower}")
    for name, rs in ratios.items():
        print(f"- {name}: geometric mean of after/before over {len(rs)} cells {statistics.geometric_mean(rs):.3f}"
              f" (range {min(rs):.3f}-{max(rs):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
