"""Scale-out of `kvtrim eval --ray` on this machine: 1 vs 2 Ray workers, and Ray's per-unit overhead (issue #14).

    python benchmarks/ray/scaling.py [--samples 8] [--length 1024] [--repeats 2] [--out benchmarks/ray]

One small sweep (passkey prompts of LENGTH tokens with the default model, `full`, `lagkv` and
`streaming` at compression 0.5: one unit = one sample's prefill and its 3 runs), timed three ways in the
same run, each REPEATS times in rotation (medians reported):

* `in_process`: `kvtrim eval`'s single-process path (`Runner.run`), 1 torch thread, model load included;
* `ray_1`: `RaySweep` with 1 worker of 1 CPU (model load in the worker included, cluster start excluded:
  the local cluster is started once, as a user's cluster is up before a sweep);
* `ray_2`: `RaySweep` with 2 workers of 1 CPU each.

Reported: wall seconds, `speedup_2_vs_1` = ray_1 / ray_2, and the per-unit overhead of Ray
(ray_1 - in_process) / units. Every variant writes the same rows (checked: same keys, predictions,
scores). Writes OUT/scaling.json and OUT/scaling.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

METHODS = ["full", "lagkv", "streaming"]
TIMING = ("seconds", "prefill_reused")


def _content(rows):
    return {r["key"]: {k: v for k, v in r.items() if k not in TIMING} for r in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join("benchmarks", "ray"))
    args = ap.parse_args()

    import ray

    from kvtrim.eval.prompt import PromptFormat
    from kvtrim.eval.ray_sweep import ModelLoader, RayOptions, RaySweep
    from kvtrim.eval.runner import Runner, RunSettings, plan
    from kvtrim.eval.tasks import generate_samples
    from kvtrim.models import load_model, load_tokenizer_and_config
    from kvtrim.specs import parse_method_specs

    torch.set_num_threads(1)
    model_name = "smollm2-135m"
    tok, _ = load_tokenizer_and_config(model_name)
    samples = generate_samples("passkey", PromptFormat(tok), args.length, args.samples, seed=0, depths=(0.5,))
    jobs = plan(samples, parse_method_specs(METHODS), [0.5])
    settings = RunSettings(model=model_name)
    units = len(samples)

    def in_process(out):
        model, tok = load_model(model_name)
        return Runner(model, tok, settings, out, progress=False).run(jobs)

    def with_ray(workers):
        def run(out):
            return RaySweep(ModelLoader(model_name), settings, out, RayOptions(workers=workers), progress=False).run(jobs)
        return run

    variants = {"in_process": in_process, "ray_1": with_ray(1), "ray_2": with_ray(2)}
    start = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    cluster_start_s = time.perf_counter() - start
    walls = {name: [] for name in variants}
    reference = None
    try:
        for _ in range(args.repeats):
            for name, run in variants.items():
                with tempfile.TemporaryDirectory() as out:
                    t0 = time.perf_counter()
                    rows = run(out)
                    walls[name].append(time.perf_counter() - t0)
                content = _content(rows)
                reference = reference or content
                assert content == reference, f"{name} wrote other rows than the first variant"
                print(f"{name}: {walls[name][-1]:.1f} s", flush=True)
    finally:
        ray.shutdown()
    med = {name: statistics.median(w) for name, w in walls.items()}
    result = {
        "command": "python benchmarks/ray/scaling.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "ray": ray.__version__, "load_average_1_5_15_min": [round(x, 2) for x in os.getloadavg()]},
        "sweep": {"model": model_name, "task": "passkey", "length": args.length, "samples": units,
                  "methods": METHODS, "compression_ratio": 0.5, "rows": len(jobs), "units": units},
        "cluster_start_s": round(cluster_start_s, 2),
        "wall_s": {name: [round(w, 2) for w in ws] for name, ws in walls.items()},
        "median_wall_s": {name: round(m, 2) for name, m in med.items()},
        "speedup_2_vs_1": round(med["ray_1"] / med["ray_2"], 3),
        "speedup_2_vs_in_process": round(med["in_process"] / med["ray_2"], 3),
        "ray_overhead_per_unit_s": round((med["ray_1"] - med["in_process"]) / units, 3),
        "same_rows": True,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scaling.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    _plot(result, os.path.join(args.out, "scaling.png"))
    print(json.dumps({k: result[k] for k in ("median_wall_s", "speedup_2_vs_1", "ray_overhead_per_unit_s")}))


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["median_wall_s"])
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, [result["median_wall_s"][n] for n in names], color=["#777", "#4a7", "#27a"])
    for i, n in enumerate(names):
        ax.text(i, result["median_wall_s"][n], f"{result['median_wall_s'][n]:.0f} s", ha="center", va="bottom")
    s = result["sweep"]
    ax.set_ylabel("wall time (s, median)")
    ax.set_title(f"{s['rows']} rows, {s['units']} units ({s['model']}, {s['length']} tokens); "
                 f"2 vs 1 worker: {result['speedup_2_vs_1']:.2f}x", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
