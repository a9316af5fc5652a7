"""From raw benchmark rows to the summary: medians over repeats and ratios against the full cache.

Per raw row, derived first: `decode_tps = decode_tokens / decode_s`, `decode_step_s = decode_s /
decode_tokens`, `evict_share_prefill = prefill_evict_s / prefill_s`, `evict_share_decode =
decode_evict_s / decode_s` (the eviction share of a decode step, averaged over the steps),
`decode_step_vs_same_size = decode_untimed_s / decode_same_size_full_s` (the method's decode step over
the step of a full cache holding as many entries as the method stored after the prompt, decoded in the
same cell: 1.0 = the physical limit; evicting cells only). `decode_untimed_s` is the same decode run on
a copy of the method's cache without the eviction timer, whose wrappers would count against the method
(results written before it existed use `decode_s`, which carries them).

The method's compression cost, for every method alike (`compression_cost`): `scoring_s` = its scoring
passes (KVzip's context reconstruction; 0 for methods without), `compress_s = prefill_evict_s +
scoring_s` (everything the method adds to the prompt: its hooks and gathers during the prefill, and its
passes), `compress_vs_prefill = compress_s / (prefill_s - prefill_evict_s)` (over the model's own
forwards of the prompt, measured in the same cell); per (method, length) also `compress_vs_full_prefill`,
the paired ratio of `compress_s` to the full cache's `prefill_s` of the same round.

Per (method, length): the median of each metric over the repeats, and each `*_vs_full` ratio as the
median over repeats of the *paired* ratio (this repeat's method value / this repeat's full-cache value
at the same length, measured in the same round): pairing cancels slow drifts of the machine.
`stored_vs_ideal` is the relative distance of the stored bytes after prefill to the ideal
`(1 - compression_ratio) * full` (0.0 = exact; -0.03 = 3 % fewer bytes than the ideal).
"""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Any

from kvtrim.methods.base import KvtrimError

FULL = "full"

#: metrics summarised by their median over repeats
METRICS = (
    "prefill_s", "prefill_evict_s", "prefill_score_s", "prefill_gather_s", "evict_share_prefill",
    "scoring_s", "compress_s", "compress_vs_prefill",
    "decode_s", "decode_tps", "decode_step_s", "decode_evict_s", "evict_share_decode",
    "prefill_evictions", "decode_evictions",
    "stored_bytes_prefill", "full_bytes_prefill", "stored_bytes_end", "full_bytes_end",
    "kv_peak_layer_sum_bytes", "kv_live_peak_bytes", "mem_peak_prefill_bytes", "mem_peak_bytes",
    "decode_untimed_s", "decode_same_size_full_s", "decode_step_vs_same_size",
    "path_peak_prefill_bytes", "path_peak_generate_bytes", "path_peak_generate_deferred_bytes", "layer_prompt_bytes",
)
#: metrics that results written before they existed lack (reports read those results too)
LATER_METRICS = ("decode_untimed_s", "decode_same_size_full_s", "decode_step_vs_same_size", "scoring_s",
                 "compress_s", "compress_vs_prefill", "path_peak_prefill_bytes", "path_peak_generate_bytes",
                 "path_peak_generate_deferred_bytes", "layer_prompt_bytes")
#: metric -> name of its paired ratio against the full cache
RATIOS = {
    "prefill_s": "prefill_vs_full",
    "decode_tps": "decode_tps_vs_full",
    "stored_bytes_prefill": "stored_vs_full",
    "stored_bytes_end": "stored_end_vs_full",
    "kv_live_peak_bytes": "kv_live_peak_vs_full",
    "mem_peak_prefill_bytes": "mem_peak_prefill_vs_full",
    "mem_peak_bytes": "mem_peak_vs_full",
    "path_peak_prefill_bytes": "path_peak_prefill_vs_full",
    "path_peak_generate_bytes": "path_peak_generate_vs_full",
    "path_peak_generate_deferred_bytes": "path_peak_generate_deferred_vs_full",
}


def compression_cost(prefill_s: float, prefill_evict_s: float, scoring_s: float = 0.0) -> tuple[float, float | None]:
    """`(compress_s, compress_vs_prefill)` of one measurement: the method's eviction work during the prefill
    plus its scoring passes, and that over the prompt's forwards without the eviction work (None when
    those took no time)."""
    compress = prefill_evict_s + scoring_s
    forward = prefill_s - prefill_evict_s
    return compress, (compress / forward if forward > 0 else None)


def derive(row: dict) -> dict:
    """The row with its derived per-repeat metrics added (rows that were skipped are returned as is)."""
    if row.get("status") != "ok":
        return dict(row)
    out = dict(row)
    out["decode_tps"] = row["decode_tokens"] / row["decode_s"] if row["decode_s"] > 0 else None
    out["decode_step_s"] = row["decode_s"] / row["decode_tokens"]
    out["evict_share_prefill"] = row["prefill_evict_s"] / row["prefill_s"] if row["prefill_s"] > 0 else None
    out["evict_share_decode"] = row["decode_evict_s"] / row["decode_s"] if row["decode_s"] > 0 else None
    out["scoring_s"] = row.get("scoring_s", 0.0)  # results written before scoring passes existed had none
    out["compress_s"], out["compress_vs_prefill"] = compression_cost(row["prefill_s"], row["prefill_evict_s"],
                                                                     out["scoring_s"])
    same = row.get("decode_same_size_full_s")
    untimed = row.get("decode_untimed_s")
    method_s = row["decode_s"] if untimed is None else untimed
    out["decode_step_vs_same_size"] = method_s / same if same else None
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(raw: list[dict], compression_ratio: float | None = None) -> list[dict]:
    """One summary row per (method, length), in the order the methods and lengths first appear, over the
    cells of the smallest batch size measured (1 by default; larger batches: `summarize_batches`)."""
    smallest = min((r.get("batch", 1) for r in raw), default=1)
    rows = [derive(r) for r in raw if r.get("batch", 1) == smallest]
    keys: list[tuple[str, int]] = []
    for r in rows:
        if (r["method"], r["length"]) not in keys:
            keys.append((r["method"], r["length"]))
    full = {(r["length"], r["repeat"]): r for r in rows if r["method"] == FULL and r.get("status") == "ok"}
    summary = []
    for method, length in keys:
        cell = [r for r in rows if r["method"] == method and r["length"] == length]
        ok = [r for r in cell if r.get("status") == "ok"]
        out: dict[str, Any] = {"method": method, "length": length, "repeats": len(ok)}
        if not ok:
            out.update(status="skipped", reason=cell[0].get("reason", ""))
            summary.append(out)
            continue
        out["status"] = "ok"
        out["prompt_tokens"] = ok[0]["prompt_tokens"]
        out["method_repr"] = ok[0].get("method_repr")
        out["prefill_schedule"] = ok[0].get("prefill_schedule")
        out["mem_kind"] = ok[0].get("mem_kind")
        out["path_peak_kind"] = ok[0].get("path_peak_kind")
        # deterministic per cell (same prompt, same method): taken from the first repeat
        out["peak_per_layer"] = ok[0].get("peak_per_layer")
        out["stored_per_layer_prefill"] = ok[0].get("stored_per_layer_prefill")
        for m in METRICS:
            out[m] = _median([r.get(m) for r in ok])
        for m, name in RATIOS.items():
            pairs = []
            for r in ok:
                base = full.get((length, r["repeat"]))
                if base is not None and r.get(m) is not None and base.get(m):
                    pairs.append(r[m] / base[m])
            out[name] = _median(pairs)
        # the compression cost over the full cache's prefill in the same round
        pairs = [r["compress_s"] / full[(length, r["repeat"])]["prefill_s"] for r in ok
                 if full.get((length, r["repeat"])) and full[(length, r["repeat"])]["prefill_s"] > 0]
        out["compress_vs_full_prefill"] = _median(pairs)
        if compression_ratio is not None and out.get("full_bytes_prefill"):
            ideal = (1 - compression_ratio) * out["full_bytes_prefill"]
            out["stored_vs_ideal"] = out["stored_bytes_prefill"] / ideal - 1 if method != FULL else None
        summary.append(out)
    return summary


def summarize_batches(raw: list[dict]) -> list[dict]:
    """One row per (method, length, batch) for `--batch-sizes`: medians over repeats of the batch's decode
    throughput (`batch_decode_tps` = batch × tokens / decode seconds), prefill time and the bytes the cache
    holds and allocates; paired ratios (same repeat) against the full cache at the same batch
    (`*_vs_full`) and against the same method at batch 1 (`batch_decode_tps_vs_batch1`); the median of
    each cell's `decode_step_vs_same_size` (its decode against a dense full cache of the same size in the
    same cell: for a ragged cache such as AdaKV's, which does not evict while decoding, the ragged
    storage and attention path against the dense one at equal mean lengths)."""
    rows = [derive(r) for r in raw]
    for r in rows:
        if r.get("status") == "ok":
            r["batch_decode_tps"] = r.get("batch", 1) * r["decode_tokens"] / r["decode_s"] if r["decode_s"] > 0 else None
    ok = {(r["method"], r["length"], r.get("batch", 1), r["repeat"]): r for r in rows if r.get("status") == "ok"}
    keys = list(dict.fromkeys((r["method"], r["length"], r.get("batch", 1)) for r in rows))
    out = []
    for method, length, batch in keys:
        cell = [r for k, r in ok.items() if k[:3] == (method, length, batch)]
        entry: dict[str, Any] = {"method": method, "length": length, "batch": batch, "repeats": len(cell)}
        if not cell:
            reason = next((r.get("reason", "") for r in rows if (r["method"], r["length"], r.get("batch", 1))
                           == (method, length, batch)), "")
            out.append({**entry, "status": "skipped", "reason": reason})
            continue
        entry.update(status="ok", prompt_tokens=cell[0]["prompt_tokens"])
        for m in ("batch_decode_tps", "decode_step_s", "prefill_s", "stored_bytes_prefill", "allocated_bytes_prefill",
                  "allocated_bytes_end", "stored_bytes_end", "decode_step_vs_same_size"):
            entry[m] = _median([r.get(m) for r in cell])

        def paired(metric: str, base_key) -> float | None:
            pairs = []
            for r in cell:
                base = ok.get(base_key(r))
                if base is not None and r.get(metric) is not None and base.get(metric):
                    pairs.append(r[metric] / base[metric])
            return _median(pairs)

        same_batch_full = lambda r: (FULL, length, batch, r["repeat"])  # noqa: E731
        entry["batch_decode_tps_vs_full"] = paired("batch_decode_tps", same_batch_full)
        entry["allocated_vs_full"] = paired("allocated_bytes_end", same_batch_full)
        entry["batch_decode_tps_vs_batch1"] = paired("batch_decode_tps", lambda r: (method, length, 1, r["repeat"]))
        out.append(entry)
    return out


# ---- files --------------------------------------------------------------------------------------
def write_json(result: dict, path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    return path


def read_json(path: str | pathlib.Path) -> dict:
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise KvtrimError(f"cannot read benchmark results {path}: {err}") from None
    if not isinstance(data, dict) or not str(data.get("schema", "")).startswith("kvtrim.bench/"):
        raise KvtrimError(f"{path} is not a kvtrim bench result (no 'schema': 'kvtrim.bench/...')")
    return data


def validate_result(data: dict) -> list[str]:
    """Problems with the layout of a result (empty list = fine). Used by tests and by `report`."""
    problems = []
    for key in ("schema", "meta", "raw", "summary", "trace"):
        if key not in data:
            problems.append(f"missing '{key}'")
    for i, r in enumerate(data.get("raw", [])):
        for key in ("method", "length", "repeat", "status"):
            if key not in r:
                problems.append(f"raw[{i}] lacks '{key}'")
        if r.get("status") == "ok":
            for key in ("prefill_s", "decode_s", "decode_tokens", "prefill_evict_s", "decode_evict_s",
                        "stored_bytes_prefill", "stored_bytes_end", "mem_peak_bytes", "kv_live_peak_bytes"):
                if not isinstance(r.get(key), (int, float)):
                    problems.append(f"raw[{i}] ('{r.get('method')}' @ {r.get('length')}) lacks number '{key}'")
    for i, s in enumerate(data.get("summary", [])):
        if s.get("status") == "ok":
            for key in METRICS:
                if key not in s and key not in LATER_METRICS:
                    problems.append(f"summary[{i}] lacks '{key}'")
    return problems
