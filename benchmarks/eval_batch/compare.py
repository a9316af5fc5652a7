"""`kvtrim eval --batch-size 4` vs 1 on a `--preset quick` subset: wall time, and the rows compared (issue #11).

    OMP_NUM_THREADS=1 python benchmarks/eval_batch/compare.py [--out benchmarks/eval_batch]

Runs the real command (`kvtrim eval ...` next to this Python, one torch thread, model load included) for each
configuration at batch size 1, then 4, into OUT/runs/<config>-b<size> (not committed), and writes
OUT/compare.json (wall and process CPU seconds from each run's invocations.jsonl, rows run, rows that
ran in batches, whether the rows equal batch 1's field for field apart from how they were computed:
`seconds`, `prefill_reused`, `batch_size`; the 1-minute load average before each run) and
OUT/compare.png. Configurations: the quick preset's NIAH depth grid at 1k tokens (3 samples of
different lengths) with five methods

* `ratios`: the preset's ratios 0.5 / 0.75 / 0.875 (at-budget: each method sized from its own prompt's
  length, so samples of different lengths share no configuration and hardly batch);
* `budgets`: `--budgets 128,256` (one configuration per cell: batches where the method may batch);
* `budgets-no-reuse`: the same with `--no-reuse` (every method in padded batches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BASE = ["--preset", "quick", "--tasks", "niah", "--lengths", "1024", "--methods", "full,snapkv,streaming,keydiff,tova",
        "--no-plots", "--quiet"]
CONFIGS = {
    "ratios": [],
    "budgets": ["--budgets", "128,256"],
    "budgets-no-reuse": ["--budgets", "128,256", "--no-reuse"],
}
HOW = ("seconds", "prefill_reused", "batch_size")


def _rows(out: str) -> dict[str, dict]:
    with open(os.path.join(out, "results.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["key"]: r for r in rows}


def _run(args: list[str], out: str) -> dict:
    if os.path.exists(out):
        subprocess.run(["rm", "-rf", out], check=True)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    kvtrim = os.path.join(os.path.dirname(sys.executable), "kvtrim")  # the installed command
    subprocess.run([kvtrim, "eval", *args, "--out", out], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(out, "invocations.jsonl"), encoding="utf-8") as f:
        inv = json.loads(f.readline())
    return {"wall_s": inv["wall_s"], "cpu_s": inv["cpu_s"], "process_s": round(time.perf_counter() - start, 1),
            "rows_run": inv["rows_run"], "load_1min_before": round(load, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("benchmarks", "eval_batch"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    result = {"command_base": "kvtrim eval " + " ".join(BASE), "configs": {}}
    for name in args.configs.split(","):
        runs = {}
        for size in (1, 4):
            out = os.path.join(args.out, "runs", f"{name}-b{size}")
            runs[size] = _run([*BASE, *CONFIGS[name], "--batch-size", str(size)], out)
            runs[size]["rows"] = _rows(out)
            print(name, size, {k: v for k, v in runs[size].items() if k != "rows"}, flush=True)
        one, four = runs[1].pop("rows"), runs[4].pop("rows")
        strip = lambda r: {k: v for k, v in r.items() if k not in HOW}  # noqa: E731
        result["configs"][name] = {
            "extra_flags": " ".join(CONFIGS[name]), "b1": runs[1], "b4": runs[4],
            "rows": len(one), "rows_batched_b4": sum(r.get("batch_size", 1) > 1 for r in four.values()),
            "identical_rows": one.keys() == four.keys() and all(strip(one[k]) == strip(four[k]) for k in one),
            "speedup_wall_b4": round(runs[1]["wall_s"] / runs[4]["wall_s"], 2),
        }
        print(name, {k: v for k, v in result["configs"][name].items() if k not in ("b1", "b4")}, flush=True)
    with open(os.path.join(args.out, "compare.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    _plot(result, os.path.join(args.out, "compare.png"))


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for k, size in enumerate(("b1", "b4")):
        walls = [result["configs"][n][size]["wall_s"] for n in names]
        ax.bar([i + (k - 0.5) * 0.38 for i in range(len(names))], walls, 0.38, label=f"--batch-size {size[1:]}")
    ax.set_xticks(range(len(names)), [f"{n}\n({result['configs'][n]['rows_batched_b4']}/{result['configs'][n]['rows']} "
                                      "rows batched)" for n in names], fontsize=8)
    ax.set_ylabel("wall seconds (1 thread)")
    ax.set_title("kvtrim eval, quick preset NIAH 1k subset: identical rows", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
