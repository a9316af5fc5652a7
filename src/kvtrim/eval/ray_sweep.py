"""`kvtrim eval --ray`: the sweep's units spread over Ray workers; the only module that imports Ray.

A unit is one sample's pending jobs (its prefill and every (method, ratio) run that reuses it, see
`Runner.run_unit`). Each worker is a Ray actor holding one `Runner`: it loads the model once (on its
first unit) and then runs units one at a time. The driver keeps every worker busy with the next unit in
plan order as soon as it returns one (dynamic scheduling: fast and slow units balance), and is the only
writer of `results.jsonl`: a unit's rows are appended when the unit returns, skipping a key already in
the file. A unit whose worker dies (killed, out of memory, node lost) wrote nothing, so it goes back to
the front of the queue and a fresh worker replaces the dead one; a unit that kills `MAX_ATTEMPTS` workers
is an error. Resuming is the single-process resume: the rows in the file are skipped, the rest is redone.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvtrim.eval.runner import RESULTS, Job, Runner, RunSettings, check_run_settings, load_rows, pending_units, write_row
from kvtrim.methods.base import KvtrimError, check

MAX_ATTEMPTS = 3  # workers a unit may lose before the sweep stops


@dataclass
class RayOptions:
    """Where and how wide: `address` None starts a local cluster, "auto" joins the running one."""

    address: str | None = None
    workers: int | None = None  # None: as many as the cluster's CPUs (GPUs) allow, at most one per unit
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0

    def check(self) -> None:
        check(self.workers is None or self.workers >= 1, f"--ray-workers must be >= 1, got {self.workers}")
        check(self.cpus_per_worker > 0, f"--ray-cpus-per-worker must be > 0, got {self.cpus_per_worker}")
        check(self.gpus_per_worker >= 0, f"--ray-gpus-per-worker must be >= 0, got {self.gpus_per_worker}")


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
            import torch

            from kvtrim.cli import load_plugins

            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # as the CLI does in the driver: no weight-loading bars in the log
            load_plugins(self.plugins)  # methods registered by --plugin modules, as in the driver
            torch.set_num_threads(self.threads)  # the CPUs Ray reserved for this worker
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
        self.retried_units = 0  # units sent again after their worker died
        self.workers_started = 0

    @property
    def summary(self) -> dict:
        """What `invocations.jsonl` records of this run's workers."""
        opt = self.options
        return {"address": opt.address or "local", "workers_started": self.workers_started,
                "retried_units": self.retried_units, "cpus_per_worker": opt.cpus_per_worker,
                "gpus_per_worker": opt.gpus_per_worker}

    def run(self, jobs: list[Job]) -> list[dict]:
        import ray

        check_run_settings(self.out_dir, self.settings)
        units = pending_units(self.out_dir, jobs)
        if not units:
            return load_rows(self.out_dir)
        started_here = not ray.is_initialized()
        if started_here:
            ray.init(address=self.options.address, logging_level=logging.WARNING, include_dashboard=False,
                     configure_logging=True)
        try:
            self._sweep(ray, jobs, units)
        finally:
            if started_here:
                ray.shutdown()  # a local cluster stops; on a running cluster the workers end with the driver
        return load_rows(self.out_dir)

    def _worker_count(self, ray, units: int) -> int:
        opt = self.options
        total = ray.cluster_resources()
        cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
        fit = int(cpus // opt.cpus_per_worker)
        if opt.gpus_per_worker:
            fit = min(fit, int(gpus // opt.gpus_per_worker))
        where = f"the Ray cluster has {cpus:g} CPU(s) and {gpus:g} GPU(s)"
        check(fit >= 1, f"{where}: not one worker of {opt.cpus_per_worker:g} CPU(s) and {opt.gpus_per_worker:g} GPU(s) fits")
        if opt.workers is not None:
            check(opt.workers <= fit, f"{where}: {opt.workers} workers of {opt.cpus_per_worker:g} CPU(s) and "
                                      f"{opt.gpus_per_worker:g} GPU(s) do not fit (at most {fit})")
            return min(opt.workers, units)
        return min(fit, units)

    def _sweep(self, ray, jobs: list[Job], units: list[list[Job]]) -> None:
        from ray.exceptions import RayActorError, RayTaskError
        from tqdm.auto import tqdm

        opt = self.options
        remote = ray.remote(num_cpus=opt.cpus_per_worker, num_gpus=opt.gpus_per_worker, max_restarts=0)(SweepWorker)
        threads = max(1, int(opt.cpus_per_worker))
        settings_ref = ray.put(self.settings)

        def new_worker():
            self.workers_started += 1
            return remote.remote(self.loader, settings_ref, self.out_dir, threads, self.plugins)

        queue = deque(units)
        attempts: dict[str, int] = {}
        written = {row.get("key") for row in load_rows(self.out_dir)}
        pending = sum(len(u) for u in units)
        bar = tqdm(total=len(jobs), initial=len(jobs) - pending, desc="kvtrim eval (ray)", unit="run",
                   disable=not self.progress, dynamic_ncols=True)
        inflight: dict = {}  # ObjectRef -> (worker, unit)

        def submit(worker) -> None:
            if queue:
                unit = queue.popleft()
                inflight[worker.run_unit.remote(unit)] = (worker, unit)

        try:
            for _ in range(self._worker_count(ray, len(units))):
                submit(new_worker())
            with open(os.path.join(self.out_dir, RESULTS), "a", encoding="utf-8") as out:
                while inflight:
                    [ref], _ = ray.wait(list(inflight), num_returns=1)
                    worker, unit = inflight.pop(ref)
                    try:
                        rows = ray.get(ref)
                    except RayActorError as err:  # the worker process died: the unit wrote nothing, redo it
                        sample = unit[0].sample.id
                        attempts[sample] = attempts.get(sample, 0) + 1
                        check(attempts[sample] < MAX_ATTEMPTS,
                              f"sample {sample}: its Ray worker died {attempts[sample]} times, the last time: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}")
                        self.retried_units += 1
                        queue.appendleft(unit)
                        ray.kill(worker, no_restart=True)
                        submit(new_worker())
                        continue
                    except RayTaskError as err:  # an error in kvtrim's code: the same as in one process
                        cause = getattr(err, "cause", None)
                        if isinstance(cause, KvtrimError):
                            raise KvtrimError(str(cause)) from None
                        raise
                    for row in rows:
                        if row["key"] in written:  # never a second row for a key
                            continue
                        write_row(out, row)
                        written.add(row["key"])
                        self.rows_written += 1
                        bar.update(1)
                    submit(worker)
        finally:
            bar.close()
            for worker, _ in inflight.values():
                ray.kill(worker, no_restart=True)
