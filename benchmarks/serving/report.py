"""Numbers of one configuration from its load, the eviction cost from its server log, and the markdown table."""

from __future__ import annotations

import re
import statistics

#: `kvtrim: stats steps=<int> step_s=<float> compaction_s=<float> compactions=<int> evicted=<int>`
#: (cumulative since the server started); fields are read by name, in any order, extra ones kept
_STATS = re.compile(r"kvtrim: stats((?:\s+\w+=\S+)+)")
_FIELD = re.compile(r"(\w+)=([^\s,;]+)")


def _fields(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in _FIELD.findall(text):
        try:
            out[k] = int(v) if re.fullmatch(r"[+-]?\d+", v) else float(v)
        except ValueError:
            pass
    return out


def last_stats(log: str) -> dict[str, float] | None:
    """The numeric fields of the last `kvtrim: stats` line of `log` with `step_s` and `compaction_s` (a line cut off or
    malformed is passed over), None without one."""
    found = None
    for m in _STATS.finditer(log):
        fields = _fields(m.group(1))
        if "step_s" in fields and "compaction_s" in fields:
            found = fields
    return found


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
    """`after - before` field by field (the load's share of cumulative counters); `after` alone without `before`."""
    if after is None:
        return None
    if before is None:
        return dict(after)
    return {k: v - before.get(k, 0) for k, v in after.items()}


def eviction_share(stats: dict | None) -> float | None:
    """compaction_s / step_s: the share of the engine's step time spent compacting (None where unknown)."""
    if not stats:
        return None
    step, comp = stats.get("step_s"), stats.get("compaction_s")
    if not isinstance(step, (int, float)) or not isinstance(comp, (int, float)) or step <= 0:
        return None
    return comp / step


def quantile(xs: list[float], q: float) -> float | None:
    """Linear-interpolation quantile (numpy's default), None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stat(values: list, fn):
    values = [v for v in values if v is not None]
    return fn(values) if values else None


def summarize(requests: list[dict], samples: list[list], keys: list[str], max_tokens: int) -> dict:
    """Metrics of one load: window = first request sent .. last stream ended."""
    ok = [r for r in requests if r["error"] is None]
    start = min(r["sent_s"] for r in requests)
    end = max(r["end_s"] for r in requests)
    window = end - start
    out_tokens = sum(r["output_tokens"] for r in ok)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    inside = [s for s in samples if start <= s[0] <= end] or samples
    running, waiting, usage = ([s[i] for s in inside] for i in (1, 2, 3))
    return {
        "requests": len(requests), "errors": len(requests) - len(ok),
        "window_s": window, "output_tokens": out_tokens,
        "exact_length": sum(r["output_tokens"] == max_tokens for r in ok),
        "output_tok_s": out_tokens / window if window > 0 else None,
        "requests_s": len(ok) / window if window > 0 else None,
        "ttft_median_s": quantile(ttft, 0.5), "ttft_p90_s": quantile(ttft, 0.9),
        "e2e_median_s": quantile([r["end_s"] - r["sent_s"] for r in ok], 0.5),
        "running_max": _stat(running, max), "running_mean": _stat(running, statistics.fmean),
        "waiting_max": _stat(waiting, max), "waiting_mean": _stat(waiting, statistics.fmean),
        "kv_usage_max": _stat(usage, max), "kv_usage_mean": _stat(usage, statistics.fmean),
        "metric_samples": len(inside),
        "passkey_found": sum(k in r["text"] for r, k in zip(requests, keys) if r["error"] is None),
    }


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _ratio(a, b) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}"


def table(runs: list[dict], reference: str = "vllm") -> str:
    """Markdown table of finished runs; the ratio columns are against the run labelled `reference`."""
    ref = next((r for r in runs if r["label"] == reference and "error" not in r), None)
    ref_tps = ref["output_tok_s"] if ref else None
    ref_run = ref["running_max"] if ref else None
    head = ("| configuration | out tok/s | × vLLM | req/s | TTFT p50 s | TTFT p90 s | running max | running mean "
            "| running max × vLLM | waiting max | KV usage max | preempted | passkey | eviction share | window s "
            "| server start s |")
    rows = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for r in runs:
        if "error" in r:
            rows.append(f"| {r['label']} | failed: {r['error'][:80]} |" + " |" * (head.count("|") - 3))
            continue
        rows.append(
            f"| {r['label']} | {_f(r['output_tok_s'], '.1f')} | {_ratio(r['output_tok_s'], ref_tps)} "
            f"| {_f(r['requests_s'], '.3f')} | {_f(r['ttft_median_s'], '.1f')} | {_f(r['ttft_p90_s'], '.1f')} "
            f"| {_f(r['running_max'], '.0f')} | {_f(r['running_mean'], '.1f')} | {_ratio(r['running_max'], ref_run)} "
            f"| {_f(r['waiting_max'], '.0f')} | {_f(r['kv_usage_max'], '.2f')} | {_f(r.get('preemptions'), '.0f')} "
            f"| {r['passkey_found']}/{r['requests'] - r['errors']} | {_f(r['eviction_share'], '.3f')} "
            f"| {_f(r['window_s'], '.1f')} | {_f(r['server_start_s'], '.0f')} |")
    return "\n".join(rows)
