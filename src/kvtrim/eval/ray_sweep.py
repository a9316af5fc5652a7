"""`kvtrim eval --ray`: the sweep's units spread over Ray workers (plumbing in `kvtrim.ray_cluster`).

A unit is one sample's pending jobs (its prefill and every (method, ratio) run that reuses it, see
`Runner.run_unit`), or with `--batch-size N` those of up to N samples of one task and length, run in
batches. Each worker is a Ray actor holding one `Runner`: it loads the model once (on its
first unit) and then runs units one at a time. The driver keeps every worker busy with the next unit in
plan order as soon as it returns one (dynamic scheduling: fast and slow units balance), and is the only
writer of `results.jsonl`: a unit's rows are appended when the unit returns, skipping a key already in
the file. A unit whose worker dies wrote nothing, so it is redone on a fresh worker (see
`ray_cluster.run_units`). Resuming is the single-process resume: the rows in the file are skipped, the
rest is redone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from kvtrim.eval.runner import RESULTS, Job, Runner, RunSettings, check_run_settings, load_rows, pending_units, write_row
from kvtrim.ray_cluster import MAX_ATTEMPTS, RayOptions, RunStats, connected, prepare_worker, run_units, worker_count


@dataclass
class ModelLoader:
    """What a worker calls to get `(model, tokenizer)`: `kvtrim.models.load_model` (picklable, sent to
    every worker). With GPUs, Ray shows each worker only its own, so `cuda` is that worker's device."""

    name: str
    dtype: str = "float32"
    device: str = "cpu"

    def __call__(self):
        from kvtrim.models import load_model

        return load_model(self.name, dtype=self.dtype, device=self.device)


class SweepWorker:
    """One worker (a Ray actor): a `Runner` on its own model, loaded at the first unit."""

    def __init__(self, loader: Callable, settings: RunSettings, out_dir: str, threads: int, plugins: list[str]):
        self.loader, self.settings, self.out_dir, self.threads = loader, settings, out_dir, threads
        self.plugins = plugins
        self.runner = None

    def run_unit(self, unit: list[Job]) -> list[dict]:
        if self.runner is None:
            prepare_worker(self.plugins, self.threads)
            model, tok = self.loader()
            self.runner = Runner(model, tok, self.settings, self.out_dir, progress=False)
        return list(self.runner.run_unit(unit))


class RaySweep:
    """The Ray counterpart of `Runner.run`: same jobs, same `results.jsonl`, same resume."""

    def __init__(self, loader: Callable, settings: RunSettings, out_dir: str, options: RayOptions,
                 progress: bool = True, plugins: list[str] | None = None):
        self.loader, self.settings, self.out_dir, self.options = loader, settings, out_dir, options
        self.progress, self.plugins = progress, list(plugins or [])
        self.rows_written = 0
        self.stats = RunStats()

    @property
    def summary(self) -> dict:
        """What `invocations.jsonl` records of this run's workers."""
        return self.stats.summary(self.options)

    @property
    def retried_units(self) -> int:
        return self.stats.retried_units

    @property
    def workers_started(self) -> int:
        return self.stats.workers_started

    def run(self, jobs: list[Job]) -> list[dict]:
        check_run_settings(self.out_dir, self.settings)
        units = pending_units(self.out_dir, jobs, self.settings.batch_size)
        if not units:
            return load_rows(self.out_dir)
        with connected(self.options) as ray:
            self._sweep(ray, jobs, units)
        return load_rows(self.out_dir)

    def _sweep(self, ray, jobs: list[Job], units: list[list[Job]]) -> None:
        from tqdm.auto import tqdm

        opt = self.options
        remote = ray.remote(num_cpus=opt.cpus_per_worker, num_gpus=opt.gpus_per_worker, max_restarts=0)(SweepWorker)
        settings_ref = ray.put(self.settings)
        written = {row.get("key") for row in load_rows(self.out_dir)}
        pending = sum(len(u) for u in units)
        bar = tqdm(total=len(jobs), initial=len(jobs) - pending, desc="kvtrim eval (ray)", unit="run",
                   disable=not self.progress, dynamic_ncols=True)
        try:
            with open(os.path.join(self.out_dir, RESULTS), "a", encoding="utf-8") as out:
                def on_result(unit, rows) -> None:
                    for row in rows:
                        if row["key"] in written:  # never a second row for a key
                            continue
                        write_row(out, row)
                        written.add(row["key"])
                        self.rows_written += 1
                        bar.update(1)

                run_units(ray, lambda slot: remote.remote(self.loader, settings_ref, self.out_dir, opt.threads,
                                                          self.plugins),
                          lambda worker, unit: worker.run_unit.remote(unit), units,
                          worker_count(ray, opt, len(units)), on_result,
                          _unit_label, self.stats)
        finally:
            bar.close()


def _unit_label(unit: list[Job]) -> str:
    ids = list(dict.fromkeys(job.sample.id for job in unit))
    return f"sample {ids[0]}" if len(ids) == 1 else f"samples {', '.join(ids)}"


__all__ = ["MAX_ATTEMPTS", "ModelLoader", "RayOptions", "RaySweep", "SweepWorker"]
