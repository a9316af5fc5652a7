"""Stored entries during decoding, from a `kvtrim eval` budget sweep's `results.jsonl`: does each method stay
within its budget (LazyEviction: budget + window) once it has started evicting?

    .venv/bin/python benchmarks/reasoning/bounds.py benchmarks/reasoning/preset

Per row: the entries before decoding (`stored_trace[0]`, after the question was appended), the peak during
decoding (`peak_stored`: a decode forward's entries, its own token included), the first generated token
after which the cache held fewer entries than it would without eviction (`stored_trace[i] < stored_trace[0]
+ i`: the first decode-time eviction), the largest number held from then on, and the bound
`budget + slack` (LazyEviction's window, KeyDiff's block size; 1 for step-wise methods). LagKV's reference
mode has no budget: it keeps `keep_ratio` of every partition, so its cache grows with the sequence (the
sweep picks `keep_ratio` so that the prompt fits the budget); no bound is checked for it.
Writes `bounds.md` into the folder.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys


def slack(row: dict) -> int | None:
    """Entries a method may hold above its budget between evictions (from its configuration string);
    None for LagKV's reference mode (no budget)."""
    config = row.get("method_config", "")
    if config.startswith("LagKV("):
        return None
    for name in ("window", "block_size"):
        m = re.search(rf"\b{name}=(\d+)", config)
        if m:
            return int(m.group(1))
    return 1


def main(folder: str) -> None:
    out = pathlib.Path(folder)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    lines = ["| sample | method | budget | before decoding | peak while decoding | first eviction at token | "
             "max after it | budget + slack | within? | new tokens |", "|" + "---|" * 10]
    for r in rows:
        if r["compression_ratio"] is not None or "stored_trace" not in r:
            continue
        trace = r["stored_trace"]
        first = next((i for i in range(1, len(trace)) if trace[i] < trace[0] + i), None)
        after = max(trace[first:]) if first is not None else None
        bound = None if slack(r) is None else r["budget"] + slack(r)
        within = "—" if after is None or bound is None else ("yes" if after <= bound else "no")
        lines.append(f"| {r['sample_id'].rsplit('/', 1)[-1]} | {r['method']} | {r['budget']} | {trace[0]} | "
                     f"{r['peak_stored']} | {first if first is not None else 'never'} | "
                     f"{after if after is not None else '—'} | {bound if bound is not None else 'n/a'} | {within} | {r['new_tokens']} |")
    (out / "bounds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(pathlib.Path(__file__).parent / "preset"))
