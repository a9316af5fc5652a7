"""Two `kvtrim eval` runs of the same jobs side by side, row by row: the in-process (transformers) path and
`kvtrim eval --server` (the vLLM engine), both query-aware.

    .venv/bin/python benchmarks/reasoning/compare_backends.py TRANSFORMERS_DIR SERVER_DIR > comparison.md

Per job: the answer's length in tokens, whether the two answers are the same text, the first character where
they part, the score and the step score on each side; then how many answers are identical.
"""

from __future__ import annotations

import json
import os
import sys


def rows(folder: str) -> dict[str, dict]:
    with open(os.path.join(folder, "results.jsonl"), encoding="utf-8") as f:
        return {r["key"]: r for r in map(json.loads, f)}


def first_difference(a: str, b: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(local_dir: str, server_dir: str) -> None:
    local, served = rows(local_dir), rows(server_dir)
    missing = sorted(set(local) ^ set(served))
    if missing:
        sys.exit(f"the two runs hold different jobs, e.g. {missing[0]}")
    print("| method | budget | tokens (transformers / vLLM) | same answer | parts at char | score (transformers / vLLM) "
          "| steps (transformers / vLLM) |")
    print("|---|---|---|---|---|---|---|")
    same = 0
    for key, t in local.items():
        s = served[key]
        at = first_difference(t["prediction"], s["prediction"])
        same += at is None
        print(f"| {t['method']} | {t['budget']} | {t['new_tokens']} / {s['new_tokens']} | {'yes' if at is None else 'no'} "
              f"| {'' if at is None else at} | {100 * t['score']:.1f} / {100 * s['score']:.1f} "
              f"| {100 * t['trace_partial']:.1f} / {100 * s['trace_partial']:.1f} |")
    print(f"\n{same} of {len(local)} answers identical.")


if __name__ == "__main__":
    main(*sys.argv[1:3])
