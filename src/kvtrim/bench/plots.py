"""Plots of a benchmark result (matplotlib, Agg backend, PNG files)."""

from __future__ import annotations

import pathlib

MIB = 2**20


def _pyplot():
    from kvtrim.extras import require

    require("matplotlib", "eval", "plotting")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(summary: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """method -> (prompt tokens, values) over the lengths where the cell ran."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in summary:
        if row.get("status") != "ok" or row.get(key) is None:
            continue
        xs, ys = out.setdefault(row["method"], ([], []))
        xs.append(row["prompt_tokens"])
        ys.append(row[key])
    return out


def _length_ticks(plt, ax) -> None:
    """Plain numbers at the measured lengths only (no log-scale minor labels)."""
    ticker = plt.matplotlib.ticker
    ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    ax.xaxis.set_minor_locator(ticker.NullLocator())


def _style(method: str) -> dict:
    return {"color": "black", "linestyle": "--", "linewidth": 2} if method == "full" else {"marker": "o"}


def _title(result: dict) -> str:
    meta = result.get("meta", {})
    env, cfg = meta.get("env", {}), meta.get("config", {})
    return (f"{meta.get('model', {}).get('name', cfg.get('model', '?'))} · {env.get('device', '?')} "
            f"{env.get('dtype', '')} · compression ratio {cfg.get('compression_ratio', '?')}")


def _save(plt, fig, result: dict, path: pathlib.Path) -> pathlib.Path:
    """Title the figure with the run's conditions, write it to `path` and free it."""
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_prefill(result: dict, path: pathlib.Path) -> pathlib.Path:
    plt = _pyplot()
    summary = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, (xs, ys) in _series(summary, "compress_vs_prefill").items():
        if method != "full":
            a.plot(xs, [100 * y for y in ys], label=method, **_style(method))
    a.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="% of the prompt's forward time",
          title="Compression cost (eviction work + scoring passes)")
    a.axhline(3, color="grey", linewidth=0.8, linestyle=":")
    for method, (xs, ys) in _series(summary, "prefill_vs_full").items():
        b.plot(xs, ys, label=method, **_style(method))
    b.set(xscale="log", xlabel="prompt tokens", ylabel="prefill time / full cache's",
          title="Prefill time relative to the full cache")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks(sorted({x for xs, _ in _series(summary, "prefill_s").values() for x in xs}))
        _length_ticks(plt, ax)
    a.text(a.get_xlim()[0], 3, " 3 %", fontsize=7, va="bottom", color="grey")
    b.legend(fontsize=8)
    return _save(plt, fig, result, path)


def plot_decode(result: dict, path: pathlib.Path) -> pathlib.Path:
    plt = _pyplot()
    summary = result["summary"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, (xs, ys) in _series(summary, "decode_tps").items():
        ax.plot(xs, ys, label=method, **_style(method))
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="decode tokens / s",
           title=f"Decode speed ({result['meta']['config'].get('new_tokens')} tokens after the prompt)")
    ax.set_xticks(sorted({x for xs, _ in _series(summary, "decode_tps").values() for x in xs}))
    _length_ticks(plt, ax)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, result, path)


def plot_memory(result: dict, path: pathlib.Path) -> pathlib.Path:
    plt = _pyplot()
    summary = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    kind = next((r.get("mem_kind") for r in summary if r.get("mem_kind")), "?")
    for method, (xs, ys) in _series(summary, "mem_peak_prefill_bytes").items():
        a.plot(xs, [y / MIB for y in ys], label=method, **_style(method))
    a.set(xlabel="prompt tokens", ylabel="MiB", title=f"Peak memory added by the prefill ({kind})")
    for method, (xs, ys) in _series(summary, "kv_live_peak_bytes").items():
        b.plot(xs, [y / MIB for y in ys], label=method, **_style(method))
    b.set(xlabel="prompt tokens", ylabel="MiB", title="Peak KV entries held at once (analytic)")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
    b.legend(fontsize=8)
    return _save(plt, fig, result, path)


def plot_trace(result: dict, path: pathlib.Path) -> pathlib.Path | None:
    traces = [t for t in result.get("trace", []) if t.get("status") == "ok" and t.get("points")]
    if not traces:
        return None
    plt = _pyplot()
    ratio = result["meta"]["config"].get("compression_ratio")
    fig, ax = plt.subplots(figsize=(8, 5))
    full_curve = None
    for t in traces:
        xs = [p[0] for p in t["points"]]
        ax.plot(xs, [p[1] / MIB for p in t["points"]], label=f"{t['method']} ({t['schedule']})",
                **({"color": "black", "linewidth": 2} if t["method"] == "full" else {"linewidth": 1.4}))
        full_curve = (xs, [p[2] / MIB for p in t["points"]])
    if full_curve and ratio is not None:
        ax.plot(full_curve[0], [(1 - ratio) * y for y in full_curve[1]], color="grey", linestyle=":",
                label=f"ideal (1 - {ratio}) x full")
    prompt = traces[0]["prompt_tokens"]
    ax.axvline(prompt, color="grey", linewidth=0.8)
    ax.text(prompt, ax.get_ylim()[1] * 0.95, " decode ->", fontsize=8, va="top")
    ax.set(xlabel="tokens seen", ylabel="stored KV MiB (all layers)",
           title="Stored KV bytes as the prompt arrives and during decoding")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, result, path)


def plot_all(result: dict, out_dir: str | pathlib.Path, prefix: str = "bench") -> list[pathlib.Path]:
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_prefill(result, out / f"{prefix}_prefill.png"),
        plot_decode(result, out / f"{prefix}_decode.png"),
        plot_memory(result, out / f"{prefix}_memory.png"),
        plot_trace(result, out / f"{prefix}_stored.png"),
    ]
    return [p for p in paths if p is not None]
