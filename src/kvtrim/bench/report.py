"""Markdown tables (for docs/results-speed.md, via benchmarks/update_readme.py) regenerated from benchmark JSON files.

    python -m kvtrim.bench.report benchmarks/bench     # rewrites README.md, DETAILS.md and the plots there
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from kvtrim.bench.summary import RATIOS, read_json, validate_result
from kvtrim.methods.base import KvtrimError

MIB = 2**20


def _f(value, fmt: str, scale: float = 1.0, none: str = "–") -> str:
    return none if value is None else format(value * scale, fmt)


def bench_table(result: dict) -> str:
    """One row per (length, method): the medians and the ratios against the full cache."""
    lines = [
        "| prompt tokens | method | prefill s (× full) | eviction ms (% of prefill) | scoring passes s "
        "| compression cost s (× prefill forward / × full prefill) | decode tok/s (× full) "
        "| stored MiB after prefill (vs ideal) | KV peak MiB, at once / Σ layers | peak mem MiB prefill "
        "(× full) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = sorted(result["summary"], key=lambda r: (r["length"], 0 if r["method"] == "full" else 1))
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['length']} | {r['method']} | skipped: {r.get('reason', '')} | | | | | | | |")
            continue
        ideal = "" if r.get("stored_vs_ideal") is None else f" ({r['stored_vs_ideal'] * 100:+.1f} %)"
        lines.append(
            f"| {r['prompt_tokens']} | {r['method']} "
            f"| {_f(r['prefill_s'], '.2f')} ({_f(r['prefill_vs_full'], '.2f')}) "
            f"| {_f(r['prefill_evict_s'], '.1f', 1000)} ({_f(r['evict_share_prefill'], '.2f', 100)} %) "
            f"| {_f(r.get('scoring_s'), '.2f')} "
            f"| {_f(r.get('compress_s'), '.2f')} ({_f(r.get('compress_vs_prefill'), '.2f')} / "
            f"{_f(r.get('compress_vs_full_prefill'), '.2f')}) "
            f"| {_f(r['decode_tps'], '.1f')} ({_f(r['decode_tps_vs_full'], '.2f')}) "
            f"| {_f(r['stored_bytes_prefill'], '.1f', 1 / MIB)}{ideal} "
            f"| {_f(r['kv_live_peak_bytes'], '.1f', 1 / MIB)} / {_f(r['kv_peak_layer_sum_bytes'], '.1f', 1 / MIB)} "
            f"| {_f(r['mem_peak_prefill_bytes'], '.0f', 1 / MIB)} ({_f(r.get('mem_peak_prefill_vs_full'), '.2f')}) |"
        )
    return "\n".join(lines)


def decode_table(result: dict) -> str:
    """Per generated token: the decode step, the step of a full cache of the same size (the physical
    limit, measured in the same cell), and the eviction work per step (methods that evict while decoding)."""
    lines = ["| prompt tokens | method | entries per layer after prefill | decode step ms | full cache of that size, "
             "step ms (step × it) | eviction per step ms (% of step) | evictions |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(result["summary"], key=lambda r: (r["length"], r["method"])):
        if r.get("status") != "ok" or r["method"] == "full":
            continue
        step = r["decode_step_s"]
        tokens = result["meta"]["config"]["new_tokens"]
        per_step = r["decode_evict_s"] / tokens
        same = r.get("decode_same_size_full_s")
        stored = r.get("stored_per_layer_prefill") or []
        entries = "–" if not stored else str(stored[0]) if stored[0] == stored[-1] else f"{stored[0]}–{stored[-1]}"
        ratio = _f(r.get("decode_step_vs_same_size"), ".2f")
        same_cell = "–" if not same else f"{same / tokens * 1000:.1f} ({ratio})"
        lines.append(f"| {r['prompt_tokens']} | {r['method']} | {entries} | {step * 1000:.1f} | {same_cell} "
                     f"| {per_step * 1000:.2f} ({_f(r['evict_share_decode'], '.1f', 100)} %) "
                     f"| {r['decode_evictions']:.0f} |")
    return "\n".join(lines)


PATH_COLUMNS = (("path_peak_prefill_bytes", "kvtrim.prefill"),
                ("path_peak_generate_bytes", "model.generate, prompt_length="),
                ("path_peak_generate_deferred_bytes", "model.generate, deferred end"))


def _has_paths(result: dict) -> bool:
    return any(r.get("path_peak_prefill_bytes") is not None for r in result["summary"])


def path_bound(r: dict, full: dict, key: str) -> float | None:
    """What a path may peak at: the full cache's activations on that path (its peak minus its stored KV)
    plus, with 10 % of room, the method's cache after the prompt and one layer's whole prompt (the one
    layer that holds it while its attention runs)."""
    if full.get(key) is None or r.get(key) is None or r.get("layer_prompt_bytes") is None:
        return None
    activations = full[key] - full["stored_bytes_prefill"]
    return activations + 1.10 * (r["stored_bytes_prefill"] + r["layer_prompt_bytes"])


def path_table(result: dict) -> str:
    """Tensor peak of each user path, per (length, method), against the full cache's on the same path."""
    head = " | ".join(f"{name} MiB (× full)" for _, name in PATH_COLUMNS)
    lines = [f"| prompt tokens | method | cache after the prompt MiB | one layer's prompt MiB | {head} |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in sorted(result["summary"], key=lambda r: (r["length"], r["method"] != "full")):
        if r.get("status") != "ok" or r.get("path_peak_prefill_bytes") is None:
            continue
        cells = []
        for key, _ in PATH_COLUMNS:
            ratio = r.get(RATIOS[key])
            cells.append("–" if r.get(key) is None else f"{r[key] / MIB:.0f} ({_f(ratio, '.2f')})")
        layer = r.get("layer_prompt_bytes")
        lines.append(f"| {r['prompt_tokens']} | {r['method']} | {r['stored_bytes_prefill'] / MIB:.1f} "
                     f"| {_f(layer, '.1f', 1 / MIB)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def path_checks(result: dict) -> list[tuple[bool, str]]:
    """Each method's peak on `kvtrim.prefill` and on `model.generate` with `prompt_length=` against
    `path_bound`: `(within, what)` per (method, path)."""
    out = []
    full = {r["length"]: r for r in result["summary"] if r["method"] == "full" and r.get("status") == "ok"}
    for r in result["summary"]:
        base = full.get(r["length"])
        if r.get("status") != "ok" or r["method"] == "full" or base is None:
            continue
        for key, name in PATH_COLUMNS[:2]:
            bound = path_bound(r, base, key)
            if bound is not None:
                out.append((r[key] <= bound, f"peak of `{r['method']}` at {r['prompt_tokens']} tokens, {name}: "
                                             f"{r[key] / MIB:.1f} MiB (bound {bound / MIB:.1f} MiB)"))
    return out


def path_targets(result: dict) -> list[str]:
    """`path_checks` as target lines."""
    return [f"- {'✅' if ok else '❌'} {what}" for ok, what in path_checks(result)]


def path_targets_line(result: dict) -> str:
    """`path_checks` in one line: how many (method, path) pairs are within their bound, and which are not."""
    checks = path_checks(result)
    missed = [what for ok, what in checks if not ok]
    text = (f"Peak within the full cache's activations + 1.1 × (cache after the prompt + one layer's prompt), on "
            f"`kvtrim.prefill` and on `model.generate` with `prompt_length=`: {len(checks) - len(missed)} of "
            f"{len(checks)}")
    return text + ("." if not missed else "; not: " + "; ".join(missed) + ".")


def _base(method: str) -> str:
    return method.split(":")[0]


def _cells(result: dict, name: str, length: int | None = None, fixed_budget: bool | None = None) -> list[dict]:
    out = []
    for r in result["summary"]:
        if r.get("status") != "ok" or _base(r["method"]) != name:
            continue
        if length is not None and r["length"] != length:
            continue
        if fixed_budget is not None and (("budget=" in r["method"]) != fixed_budget):
            continue
        out.append(r)
    return out


def targets(result: dict) -> list[str]:
    """The project's speed/memory targets, checked against this result (where it has the cells)."""
    out = []
    lengths = sorted({r["length"] for r in result["summary"]})
    at4k = 4096 if 4096 in lengths else None
    for name in ("lagkv", "keydiff"):
        for r in _cells(result, name, at4k) if at4k else []:
            share = r["evict_share_prefill"]
            ok = share is not None and share <= 0.01
            out.append(f"- {'✅' if ok else '❌'} eviction bookkeeping of `{r['method']}` at {r['prompt_tokens']} "
                       f"tokens: {share * 100:.2f} % of prefill (target ≤ 1 %)")
    for r in result["summary"]:
        ratio = r.get("decode_step_vs_same_size")
        if r.get("status") != "ok" or r["method"] == "full" or ratio is None:
            continue
        out.append(f"- {'✅' if ratio <= 1.10 else '❌'} decode step of `{r['method']}` at {r['prompt_tokens']} "
                   "tokens: "
                   f"{ratio:.2f} × the step of a full cache of the same size (target within 10 %)")
    for r in _cells(result, "lazyeviction"):
        share = r["evict_share_decode"]
        ok = share is not None and share < 0.10
        out.append(f"- {'✅' if ok else '❌'} LazyEviction per-step overhead (`{r['method']}`, {r['prompt_tokens']} "
                   f"tokens): {share * 100:.1f} % of a decode step (target < 10 %)")
    top = max(lengths) if lengths else None
    for r in result["summary"]:
        if r.get("status") != "ok" or r["method"] == "full" or r["length"] != top or "budget=" in r["method"]:
            continue
        tps = r.get("decode_tps_vs_full")
        ideal = r.get("stored_vs_ideal")
        if not r.get("prefill_evictions"):
            out.append(f"- ➖ `{r['method']}` evicts nothing during the prefill (a decode-time method): decode "
                       f"{_f(tps, '.2f')} × full over {result['meta']['config']['new_tokens']} tokens; the stored-bytes "
                       "target does not apply")
            continue
        out.append(
            f"- {'✅' if tps and tps > 1 else '❌'} decode speed of `{r['method']}` at {r['prompt_tokens']} tokens: "
            f"{_f(tps, '.2f')} × full; {'✅' if ideal is not None and abs(ideal) <= 0.02 else '❌'} stored bytes "
            f"{_f(ideal, '+.1f', 100)} % vs ideal (target within 2 %)"
        )
    fixed: dict[str, list[dict]] = {}  # one flat-peak check per fixed-budget KeyDiff configuration
    for r in _cells(result, "keydiff", fixed_budget=True):
        fixed.setdefault(r["method"], []).append(r)
    for method, cells in fixed.items():
        if len({r["length"] for r in cells}) < 2:
            continue  # flat in context length needs at least two lengths
        peaks = [(r["prompt_tokens"], r["kv_live_peak_bytes"], r["mem_peak_prefill_bytes"], r.get("peak_per_layer"))
                 for r in sorted(cells, key=lambda r: r["length"])]
        kv = [p[1] for p in peaks[1:]]
        flat = max(kv) <= min(kv) * 1.001
        out.append(
            f"- {'✅' if flat else '❌'} KeyDiff block-wise prefill, fixed budget (`{method}`): analytic KV "
            f"peak {', '.join(f'{p[1] / MIB:.1f}' for p in peaks)} MiB at {', '.join(str(p[0]) for p in peaks)} tokens; "
            f"(entries per layer at most {', '.join(str(p[3][1]) if p[3] else '?' for p in peaks)}); "
            f"measured prefill peak {', '.join(f'{p[2] / MIB:.0f}' for p in peaks)} MiB"
        )
    return out


def _load(values) -> str:
    return "?" if not values else "/".join(f"{v:.1f}" for v in values)


def environment_line(result: dict) -> str:
    env, cfg = result["meta"]["env"], result["meta"]["config"]
    model = result["meta"].get("model", {})
    device = env.get("gpu") or f"{env.get('processor')} ({env.get('cpu_count')} cores, {env.get('torch_threads')} threads)"
    return (f"model `{model.get('name', cfg['model'])}` ({model.get('weights', 'pretrained')} weights), {env['dtype']}, "
            f"{env.get('attn_implementation')}, {device}, torch {env['torch']}, transformers {env['transformers']}; "
            f"compression ratio {cfg['compression_ratio']}, {cfg['new_tokens']} decoded tokens, "
            f"{cfg['repeats']} repeat(s), medians; load average {_load(env.get('loadavg_start'))} → "
            f"{_load(env.get('loadavg_end'))}; "
            f"{env['date']}, {result['meta'].get('wall_s', 0) / 60:.1f} min")


def result_section(result: dict, name: str) -> str:
    cmd = result["meta"].get("command", "")
    parts = [f"### {name}", "", f"`{cmd}`" if cmd else "", "", environment_line(result), "",
             bench_table(result), "", "Decode step, against a full cache of the same size, and its eviction work:", "",
             decode_table(result)]
    if result.get("batch_summary"):
        parts += ["", "Batches (`--batch-sizes`: distinct prompts of equal length, one cache):", "", batch_table(result)]
    if _has_paths(result):
        parts += ["", "Peak tensor memory of each path a user runs the prompt through (prompt + one decode step, "
                  "untimed, first repeat):", "", path_table(result)]
    goals = targets(result) + path_targets(result)
    if goals:
        parts += ["", "Targets:", "", *goals]
    return "\n".join(parts)


def batch_table(result: dict) -> str:
    """One row per (length, batch, method): the batch's decode throughput against the full cache at the
    same batch and against the same method at batch 1, and the bytes the cache allocates."""
    lines = ["| tokens | batch | method | decode tok/s (batch) | × full, same batch | × batch 1 | decode step × "
             "same-size full | allocated MiB (end) | allocated × full |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in sorted(result["batch_summary"], key=lambda r: (r["length"], r["batch"], r["method"] != "full")):
        if r.get("status") != "ok":
            lines.append(f"| {r['length']} | {r['batch']} | {r['method']} | skipped: {r.get('reason', '')} | | | | | |")
            continue
        lines.append(f"| {r['prompt_tokens']} | {r['batch']} | {r['method']} | {fmt(r['batch_decode_tps'], '.1f')} | "
                     f"{fmt(r['batch_decode_tps_vs_full'], '.2f')} | {fmt(r['batch_decode_tps_vs_batch1'], '.2f')} | "
                     f"{fmt(r.get('decode_step_vs_same_size'), '.2f')} | "
                     f"{fmt(r['allocated_bytes_end'] and r['allocated_bytes_end'] / 2**20, '.1f')} | "
                     f"{fmt(r['allocated_vs_full'], '.3f')} |")
    return "\n".join(lines)


def headline_table(result: dict) -> str:
    """Compact: one row per method, at the largest length (eviction share also at 4096 when measured)."""
    lengths = sorted({r["length"] for r in result["summary"] if r.get("status") == "ok"})
    if not lengths:
        return ""
    top = lengths[-1]
    mid = 4096 if 4096 in lengths and 4096 != top else None
    by = {(r["method"], r["length"]): r for r in result["summary"]}
    methods = list(dict.fromkeys(r["method"] for r in result["summary"]))
    top_tokens = next((r["prompt_tokens"] for r in result["summary"] if r["length"] == top and r.get("prompt_tokens")), top)
    head = ["method"]
    if mid:
        head.append("eviction % of prefill @4096")
    head += [f"eviction % of prefill @{top_tokens}", f"eviction % of a decode step @{top_tokens}",
             f"prefill × full @{top_tokens}", f"decode tok/s × full @{top_tokens}",
             f"decode step × same-size full @{top_tokens}", f"stored vs ideal @{top_tokens}",
             f"peak prefill memory × full @{top_tokens}",
             f"compression cost (eviction + scoring passes) × prefill forward @{top_tokens}"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for m in methods:
        r = by.get((m, top), {})
        if r.get("status") != "ok":
            lines.append(f"| {m} | " + " | ".join(["–"] * (len(head) - 2)) + f" | skipped: {r.get('reason', '')} |")
            continue
        cells = [f"`{m}`"]
        if mid:
            rm = by.get((m, mid), {})
            cells.append(_f(rm.get("evict_share_prefill"), ".2f", 100) + " %" if rm.get("status") == "ok" else "–")
        ideal = r.get("stored_vs_ideal")
        cells += [_f(r["evict_share_prefill"], ".2f", 100) + " %", _f(r["evict_share_decode"], ".2f", 100) + " %",
                  _f(r["prefill_vs_full"], ".2f"), _f(r["decode_tps_vs_full"], ".2f"),
                  _f(r.get("decode_step_vs_same_size"), ".2f"), "–" if ideal is None else f"{ideal * 100:+.1f} %",
                  _f(r.get("mem_peak_prefill_vs_full"), ".2f"), _f(r.get("compress_vs_prefill"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _results(directory: pathlib.Path) -> list[tuple[pathlib.Path, dict]]:
    out = []
    for path in sorted(directory.glob("*.json")):
        if path.name.startswith("kvpress"):
            continue
        try:
            result = read_json(path)
        except KvtrimError:
            continue
        problems = validate_result(result)
        if problems:
            raise KvtrimError(f"{path}: {problems[0]}")
        out.append((path, result))
    return out


def write_readme(directory: str | pathlib.Path, intro: str | None = None, plots: bool = True) -> pathlib.Path:
    """From every `*.json` bench result in `directory`: `DETAILS.md` (every table, the plots; with `plots`
    the PNGs are redrawn) and the compact `README.md` (headline tables, targets, the kvpress comparison),
    which `benchmarks/update_readme.py` copies into docs/results-speed.md; `paths.md` (the peak tensor
    memory per user path of the results that measured it), copied into the README."""
    from kvtrim.bench.plots import plot_all

    directory = pathlib.Path(directory)
    results = _results(directory)
    if not results:
        raise KvtrimError(f"no benchmark JSON in {directory}")
    details, compact = [intro or _INTRO], ["### Speed and memory (`kvtrim bench`)", ""]
    for path, result in results:
        if plots:
            plot_all(result, directory, prefix=path.stem)
        images = "\n".join(f"![{p.stem}]({p.name})" for p in sorted(directory.glob(f"{path.stem}_*.png")))
        details.append(result_section(result, path.stem) + "\n\n" + images)
        cmd = result["meta"].get("command", "")
        compact += [f"**{path.stem}** — `{cmd}`", "", environment_line(result), "", headline_table(result), ""]
        if result.get("batch_summary"):
            compact += [batch_table(result), ""]
        if _has_paths(result):
            compact += ["Peak tensor memory per path (prompt + one decode step):", "", path_table(result), ""]
        goals = targets(result) + path_targets(result)
        if goals:
            compact += [*goals, ""]
    where = os.path.relpath(directory) if not os.path.relpath(directory).startswith("..") else directory.as_posix()
    compact.append(f"All tables, decode-time costs and plots: `{where}/DETAILS.md`; raw numbers: `{where}/*.json`.")
    compare = directory / "kvpress_compare.md"
    if compare.exists():
        text = compare.read_text()
        details.append(text)
        compact += ["", text.replace("## Side by side with kvpress", "### Side by side with kvpress")]
    notes = directory / "notes.md"  # hand-written reading of the numbers, kept next to them
    if notes.exists():
        details.append(notes.read_text())
        compact += ["", notes.read_text()]
    paths = [f"**{path.stem}** — `{result['meta'].get('command', '')}`\n\n{environment_line(result)}\n\n"
             f"{path_table(result)}\n\n{path_targets_line(result)}"
             for path, result in results if _has_paths(result)]
    if paths:  # the README's peak-memory table (benchmarks/update_readme.py)
        (directory / "paths.md").write_text("\n\n".join(paths).rstrip() + "\n")
    (directory / "DETAILS.md").write_text("\n\n".join(details).rstrip() + "\n")
    out = directory / "README.md"
    out.write_text("\n".join(compact).rstrip() + "\n")
    return out


_INTRO = """# kvtrim bench: speed and memory (details)

Generated by `python -m kvtrim.bench.report benchmarks/bench` from the JSON files in this folder
(each made by the `kvtrim bench` command shown above its table). Columns:

* **prefill s (× full)**: wall time of the prompt's forward pass(es), median over repeats; in brackets,
  the median of the paired ratio to the full cache measured in the same round.
* **eviction ms (% of prefill)**: the part of the prefill spent choosing what to evict (the method's
  hooks: scoring) and building the smaller tensors (gather), timed around exactly those calls.
* **scoring passes s**: the method's own forwards that score the prompt before it ends (KVzip's
  context reconstruction; `kvtrim.compress.run_scoring_passes`), outside the prefill time.
* **compression cost s (× prefill forward / × full prefill)**: everything the method adds to the prompt,
  eviction work + scoring passes; in brackets over the same cell's prompt forwards (prefill minus its
  eviction work) and over the full cache's prefill of the same round (paired medians).
* **decode tok/s (× full)**: greedy decoding of the given number of tokens after the prompt.
* **Decode table**: the decode step; the step of a *full cache of the same size* (a cache that evicts
  nothing, holding in each layer as many entries as the method stored after the prompt, decoded for the
  same number of tokens right after the method in the same cell: the physical limit), with the
  method's step as a multiple of it (that step timed on a copy of the method's cache without the
  eviction timer, whose wrappers cost a few % of a step); the eviction work per step (hooks and gathers,
  averaged over the decoded tokens) and its share of the step.
* **stored MiB after prefill (vs ideal)**: `cache.stats().bytes_stored`; in brackets, the distance to
  the ideal `(1 - compression ratio) × full`.
* **KV peak MiB**: analytic, from the entries held: *at once* = most entries held by all layers
  together after an append, before eviction; *Σ layers* = sum of each layer's own peak (`TrimLayer.peak`).
* **peak mem MiB prefill**: measured: on CPU the kernel's resident-set high-water mark during the
  prefill minus the resident set before it (reset through `/proc/self/clear_refs`); on CUDA
  `max_memory_allocated` minus the allocation before it. Activations are included.
* **Peak tensor memory per path** (`kvtrim.bench.paths`, skipped by `--no-path-memory`): the prompt and one
  decode step run once more, untimed, from a fresh cache, through `kvtrim.prefill` (declared forwards, the
  method's blocks), stock `model.generate` with `TrimCache(..., prompt_length=n)` (each layer evicts after
  its attention in the prompt's forward), and stock `model.generate` without it (the prompt ends at the
  first decode step). Tensors only, above what was allocated before: on CPU from torch's allocation
  records (the profiler's memory events), on CUDA `max_memory_allocated`; activations are included. The
  target line per method: at most the full cache's activations on that path (its peak minus its KV) plus
  1.1 × (the method's cache after the prompt + one layer's whole prompt).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtrim.bench.report", description=__doc__)
    parser.add_argument("directory", help="folder holding bench JSON files (README.md is written there)")
    args = parser.parse_args(argv)
    try:
        print(write_readme(args.directory))
    except KvtrimError as err:
        print(f"kvtrim: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
