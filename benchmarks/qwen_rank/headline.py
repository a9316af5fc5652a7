"""The ranking run's headline table (README): each method's average at both compression ratios, and over the
five needle tasks on essays, with 95 % intervals, from the committed rows.

    .venv/bin/python benchmarks/qwen_rank/headline.py      # writes benchmarks/qwen_rank/headline.md

The cells and their intervals are `kvtrim eval`'s own (`kvtrim.eval.report.summarize` on `results.jsonl`:
the same numbers as summary.md's avg column); the needle column is the same summary over those tasks' rows.
"""

from __future__ import annotations

import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))

from kvtrim.eval.report import summarize  # noqa: E402

NEEDLES = ("niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery")
RATIOS = (0.5, 0.75)


def averages(rows: list[dict]) -> dict[tuple[str, float], dict]:
    """(method, ratio) -> the average record over the rows' tasks (the full cache under both ratios)."""
    out = {}
    for rec in summarize(rows):
        if rec["task"] == "average" and rec.get("score") is not None:
            out[(rec["method"], rec["compression_ratio"])] = rec
    return out


def cell(rec: dict | None) -> str:
    if rec is None:
        return "–"
    mark = {1: " ▲", -1: " ▼"}.get(rec.get("vs_full"), "")
    return f"{rec['score']:.1f} [{rec['ci_low']:.0f}, {rec['ci_high']:.0f}]{mark}"


def main() -> int:
    rows = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines() if line.strip()]
    every, needles = averages(rows), averages([r for r in rows if r["task"] in NEEDLES])
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "full"]
    methods.sort(key=lambda m: -every[(m, RATIOS[-1])]["score"])
    n_all = every[("full", 0.0)]["n"]
    n_needles = needles[("full", 0.0)]["n"]
    lines = [f"| method | all 9 tasks, compression 0.5 (n={n_all}) | all 9 tasks, 0.75 | 5 essay needle tasks, 0.75 "
             f"(n={n_needles}) |", "|---|---|---|---|",
             f"| full cache | {cell(every[('full', 0.0)])} | (same) | {cell(needles[('full', 0.0)])} |"]
    for m in methods:
        lines.append(f"| `{m}` | {cell(every.get((m, 0.5)))} | {cell(every.get((m, 0.75)))} "
                     f"| {cell(needles.get((m, 0.75)))} |")
    lines += ["", "Score ×100 (RULER's string_match_all, mean over samples then tasks) [95 % interval]; ▼: the "
              "interval lies entirely below the full cache's. Essay needle tasks: " + ", ".join(NEEDLES) + "."]
    (HERE / "headline.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
