"""serving.png from results.json: output throughput and requests running at once per configuration,
plain vLLM as the dashed reference line. Needs only matplotlib (not in .venv-serve: run.py calls this
file with the repository's .venv when its own interpreter lacks it).

    .venv/bin/python benchmarks/serving/plot.py benchmarks/serving/results/results.json
"""

from __future__ import annotations

import json
import pathlib
import sys


def plot(results: pathlib.Path, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    runs = [r for r in data["runs"] if "error" not in r]
    if not runs:
        raise SystemExit(f"plot.py: error: no finished configuration in {results}")
    # a spec on two lines (method, then its parameters) so that neighbouring labels do not run into each other
    labels = ["plain vLLM" if r["label"] == "vllm" else r["label"].replace(":", "\n", 1) for r in runs]
    ref = next((r for r in runs if r["label"] == "vllm"), None)
    colors = ["0.55" if r["label"] == "vllm" else "tab:blue" for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 2.2 * len(runs) + 2), 4.2))
    # running: the mean over the load window is what a long load is about (plain vLLM admits every short prompt
    # at first, then preempts them as they grow: its max says little), the max a dot
    panels = [("output_tok_s", "output tokens/s (load window)"),
              ("running_mean", "requests running at once (bars: mean, dots: max)")]
    for ax, (key, title) in zip(axes, panels):
        values = [r[key] or 0 for r in runs]
        ax.bar(range(len(runs)), values, color=colors)
        if key == "running_mean":
            ax.plot(range(len(runs)), [r["running_max"] or 0 for r in runs], "o", color="tab:orange", label="max")
            ax.legend(loc="lower right", fontsize=8)
        if ref is not None and ref[key]:
            ax.axhline(ref[key], ls="--", color="0.3", lw=1, label="plain vLLM")
        ax.set_xticks(range(len(runs)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    c = data["config"]
    fig.suptitle(f"{c['model']}: {c['requests']} requests × ~{c['prompt_tokens']} prompt + {c['max_tokens']} output "
                 f"tokens, {c['blocks']} KV blocks (grey: plain vLLM)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: plot.py RESULTS_JSON (writes serving.png next to it)")
    path = pathlib.Path(sys.argv[1])
    plot(path, path.with_name("serving.png"))
    print(f"wrote {path.with_name('serving.png')}")
