"""`kvtrim bench --ray`: the benchmark's context lengths measured on different Ray workers.

A unit is one context length: every method at that length, all repeats, interleaved exactly as
`run_bench` does in one process (with its own warm-up); the stored-bytes trace runs with the first
length's unit. Timing never shares a device: with GPUs every worker holds whole GPUs of its own
(`--ray-gpus-per-worker` a whole number); on CPUs every worker runs on a node of its own (a
STRICT_SPREAD placement group), so N CPU workers need N nodes. The driver merges the units' rows in
length order, recomputes the summary from them and rewrites the JSON after every unit, so an
interrupted run keeps the lengths it finished. `--time-budget` applies to each unit.

Numbers from different workers are comparable only when the workers are alike: the JSON records each
unit's node and environment (`meta.ray.units`).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace
from typing import Callable

from kvtrim.bench.runner import BenchConfig, run_bench
from kvtrim.methods.base import check
from kvtrim.ray_cluster import RayOptions, RunStats, connected, prepare_worker, run_units, worker_count


@dataclass
class BenchLoader:
    """What a worker calls to get `(model, tokenizer or None, info)`: `load_bench_model`, picklable."""

    name: str
    dtype: str = "float32"
    device: str = "cpu"
    max_context: int | None = None
    seed: int = 0

    def __call__(self):
        from kvtrim.bench.arch import load_bench_model

        return load_bench_model(self.name, self.dtype, self.device, self.max_context, self.seed)


class BenchWorker:
    """One worker (a Ray actor): its model, loaded at the first unit, then `run_bench` per unit."""

    def __init__(self, loader: Callable, threads: int, plugins: list[str]):
        self.loader, self.threads, self.plugins = loader, threads, plugins
        self.loaded = None

    def run(self, config: BenchConfig) -> dict:
        import platform

        import ray

        if self.loaded is None:
            prepare_worker(self.plugins, self.threads)
            self.loaded = self.loader()
            gc.collect()
            gc.freeze()  # as the CLI does: the model's objects are permanent, later collections stay cheap
        model, tok, info = self.loaded
        result = run_bench(model, tok, config, progress=lambda message: None, model_info=info)
        result["meta"]["node"] = {"id": ray.get_runtime_context().get_node_id(), "host": platform.node()}
        return result


def check_bench_options(options: RayOptions) -> None:
    """What bench needs beyond `RayOptions.check`, before anything starts: no fraction of a GPU."""
    gpus = options.gpus_per_worker
    check(gpus == 0 or (gpus >= 1 and float(gpus).is_integer()),
          f"kvtrim bench --ray times each worker on GPUs of its own: --ray-gpus-per-worker must be 0 or a whole "
          f"number, got {gpus:g}")


def bench_units(config: BenchConfig) -> list[BenchConfig]:
    """One config per context length; only the first length's unit runs the stored-bytes trace."""
    return [replace(config, lengths=[length], trace_length=config.trace_length if i == 0 else 0)
            for i, length in enumerate(config.lengths)]


def merge_results(config: BenchConfig, done: dict[int, dict], stats: dict, wall_s: float) -> dict:
    """The single-process result shape from the units finished so far (`done`: length -> result)."""
    from kvtrim.bench.runner import SCHEMA
    from kvtrim.bench.summary import summarize, summarize_batches

    parts = [done[length] for length in config.lengths if length in done]
    raw = [row for part in parts for row in part["raw"]]
    trace = [t for part in parts for t in part["trace"]]
    first = parts[0]["meta"] if parts else {}
    meta = {
        "config": config.as_dict(),
        "env": first.get("env", {}),
        "model": first.get("model", {}),
        "prompt_tokens": {k: v for part in parts for k, v in part["meta"]["prompt_tokens"].items()},
        "repeats_done": min((part["meta"].get("repeats_done", 0) for part in parts), default=0),
        "complete": len(parts) == len(config.lengths) and all(part["meta"]["complete"] for part in parts),
        "wall_s": wall_s,
        "ray": {**stats, "units": [{"length": length, "node": done[length]["meta"]["node"],
                                    "wall_s": done[length]["meta"]["wall_s"], "env": done[length]["meta"]["env"]}
                                   for length in config.lengths if length in done]},
    }
    out = {"schema": SCHEMA, "meta": meta, "raw": raw, "summary": summarize(raw, config.compression_ratio),
           "trace": trace}
    if config.batch_sizes != [1]:
        out["batch_summary"] = summarize_batches(raw)
    return out


def _cpu_nodes(ray, cpus: float) -> int:
    """Alive nodes with room for one worker of `cpus` CPUs."""
    return sum(1 for node in ray.nodes() if node.get("Alive") and node.get("Resources", {}).get("CPU", 0) >= cpus)


def run_bench_ray(loader: BenchLoader, config: BenchConfig, options: RayOptions, plugins: list[str] | None = None,
                  checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run the benchmark's lengths on Ray workers; returns what `run_bench` returns, plus `meta.ray`."""
    config.validate()
    options.check()
    check_bench_options(options)
    if config.threads is None:
        config = replace(config, threads=options.threads)
    units = bench_units(config)
    stats = RunStats()
    done: dict[int, dict] = {}
    started = time.perf_counter()

    with connected(options) as ray:
        remote = ray.remote(num_cpus=options.cpus_per_worker, num_gpus=options.gpus_per_worker,
                            max_restarts=0)(BenchWorker)
        if options.gpus_per_worker:  # Ray hands each worker GPUs of its own
            workers = worker_count(ray, options, len(units))

            def new_worker(slot: int):
                return remote.remote(loader, config.threads, list(plugins or []))
        else:  # one worker per node: CPU timings must not share a machine
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            nodes = _cpu_nodes(ray, options.cpus_per_worker)
            workers = options.workers if options.workers is not None else min(nodes, len(units))
            check(nodes >= 1 and workers <= nodes,
                  f"kvtrim bench --ray runs one CPU worker per node (timings never share a machine): {workers} "
                  f"worker(s) of {options.cpus_per_worker:g} CPU(s) need {workers} node(s), the cluster has {nodes}")
            workers = min(workers, len(units))
            group = placement_group([{"CPU": options.cpus_per_worker}] * workers, strategy="STRICT_SPREAD")
            ray.get(group.ready())

            def new_worker(slot: int):
                where = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=slot)
                return remote.options(scheduling_strategy=where).remote(loader, config.threads, list(plugins or []))

        def on_result(unit: BenchConfig, result: dict) -> None:
            done[unit.lengths[0]] = result
            if checkpoint is not None:
                checkpoint(merge_results(config, done, stats.summary(options), time.perf_counter() - started))

        try:
            run_units(ray, new_worker, lambda worker, unit: worker.run.remote(unit), units, workers, on_result,
                      lambda unit: f"length {unit.lengths[0]}", stats)
        finally:
            if not options.gpus_per_worker:
                remove_placement_group(group)
    return merge_results(config, done, stats.summary(options), time.perf_counter() - started)


__all__ = ["BenchLoader", "BenchWorker", "bench_units", "check_bench_options", "merge_results", "run_bench_ray"]
