"""Ray plumbing shared by `kvtrim eval --ray` and `kvtrim bench --ray`: the flags, connecting to a
cluster, sizing the workers, and a driver loop that keeps every worker busy with the next unit of work.

A unit is whatever a front end sends one worker at a time (an eval sample's runs, a bench context
length). Workers are Ray actors that keep their model between units. When a worker dies (killed, out
of memory, node lost) its unit returned nothing, so the unit goes back to the front of the queue and a
fresh worker replaces the dead one; a unit that kills `MAX_ATTEMPTS` workers is an error. An error
raised by kvtrim inside a worker (`KvtrimError`) is the same one-line error as in one process.

Ray is imported only inside these functions: without the `kvtrim[ray]` extra nothing here is loaded.
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvtrim.methods.base import KvtrimError, check, one_line

MAX_ATTEMPTS = 3  # workers a unit may lose before the run stops
RAY_FLAGS = ("ray_workers", "ray_cpus_per_worker", "ray_gpus_per_worker")


@dataclass
class RayOptions:
    """Where and how wide: `address` None starts a local cluster, "auto" joins the running one."""

    address: str | None = None
    workers: int | None = None  # None: as many as the cluster fits, at most one per unit
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0

    def check(self) -> None:
        for name in ("workers", "cpus_per_worker", "gpus_per_worker"):
            value = getattr(self, name)
            flag = "--ray-" + name.replace("_", "-")
            if name == "workers":
                check(value is None or (isinstance(value, int) and not isinstance(value, bool)),
                      f"{flag} must be an integer, got {value!r}")
            else:
                check(isinstance(value, (int, float)) and not isinstance(value, bool),
                      f"{flag} must be a number, got {value!r}")
        check(self.workers is None or self.workers >= 1, f"--ray-workers must be >= 1, got {self.workers}")
        check(self.cpus_per_worker > 0, f"--ray-cpus-per-worker must be > 0, got {self.cpus_per_worker}")
        check(self.gpus_per_worker >= 0, f"--ray-gpus-per-worker must be >= 0, got {self.gpus_per_worker}")

    @property
    def threads(self) -> int:
        """torch threads of a worker: the CPUs Ray reserved for it."""
        return max(1, int(self.cpus_per_worker))


@dataclass
class RunStats:
    """What `invocations.jsonl` / the bench JSON record of a run's workers."""

    workers_started: int = 0
    retried_units: int = 0

    def summary(self, options: RayOptions) -> dict:
        return {"address": options.address or "local", "workers_started": self.workers_started,
                "retried_units": self.retried_units, "cpus_per_worker": options.cpus_per_worker,
                "gpus_per_worker": options.gpus_per_worker}


def add_ray_arguments(parser, unit: str) -> None:
    """The `--ray*` flags, the same in every subcommand; `unit` says what one worker runs at a time."""
    r = parser.add_argument_group("scale-out on Ray (needs kvtrim[ray]; see docs/cli.md, 'Sweeps on several GPUs or nodes')")
    r.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help=f"spread the {unit} over Ray workers: a local cluster (no ADDRESS), `auto` "
                        "(the running cluster) or ray://HOST:PORT")
    r.add_argument("--ray-workers", type=int, metavar="N", help="workers (default: as many as the cluster fits)")
    r.add_argument("--ray-cpus-per-worker", type=float, metavar="C",
                   help="CPUs per worker, also its torch threads (default 1)")
    r.add_argument("--ray-gpus-per-worker", type=float, metavar="G",
                   help="GPUs per worker (default 0; 1 with --device cuda)")


def ray_options(args) -> RayOptions | None:
    """`RayOptions` for `--ray` (None without it); its flags without `--ray` are an error, not ignored."""
    given = [name for name in RAY_FLAGS if getattr(args, name) is not None]
    if args.ray is None:
        check(not given, f"--{given[0].replace('_', '-') if given else ''} needs --ray")
        return None
    gpus = args.ray_gpus_per_worker
    if gpus is None:
        gpus = 1.0 if str(args.device).startswith("cuda") else 0.0
    options = RayOptions(address=None if args.ray == "local" else args.ray, workers=args.ray_workers,
                         cpus_per_worker=1.0 if args.ray_cpus_per_worker is None else args.ray_cpus_per_worker,
                         gpus_per_worker=gpus)
    options.check()
    return options


@contextmanager
def connected(options: RayOptions) -> Iterator[Any]:
    """The `ray` module, initialised: a local cluster started here is shut down at the end; a running
    cluster (or one the caller initialised) is left as it is."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=options.address, logging_level=logging.WARNING, include_dashboard=False,
                 configure_logging=True)
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()  # a local cluster stops; on a running cluster the workers end with the driver


def worker_count(ray, options: RayOptions, units: int) -> int:
    """Workers to start: `options.workers` (an error if they do not fit) or as many as fit, at most one
    per unit."""
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0), total.get("GPU", 0)
    fit = int(cpus // options.cpus_per_worker)
    if options.gpus_per_worker:
        fit = min(fit, int(gpus // options.gpus_per_worker))
    where = f"the Ray cluster has {cpus:g} CPU(s) and {gpus:g} GPU(s)"
    shape = f"{options.cpus_per_worker:g} CPU(s) and {options.gpus_per_worker:g} GPU(s)"
    check(fit >= 1, f"{where}: not one worker of {shape} fits")
    if options.workers is not None:
        check(options.workers <= fit, f"{where}: {options.workers} workers of {shape} do not fit (at most {fit})")
        return min(options.workers, units)
    return min(fit, units)


def prepare_worker(plugins: list[str], threads: int) -> None:
    """What a worker does before loading its model, as the CLI does in the driver: methods registered by
    `--plugin` modules, torch threads = the CPUs Ray reserved, no weight-loading bars in the log."""
    import torch
    from transformers.utils import logging as hf_logging

    from kvtrim.cli import load_plugins

    hf_logging.disable_progress_bar()
    load_plugins(plugins)
    torch.set_num_threads(threads)


def run_units(ray, new_worker: Callable[[int], Any], call: Callable[[Any, Any], Any], units: list,
              workers: int, on_result: Callable[[Any, Any], None], describe: Callable[[Any], str],
              stats: RunStats) -> None:
    """Run `units` on `workers` Ray actors, dynamically: each worker gets the next unit as soon as it
    returns one. `new_worker(slot)` starts the actor for worker slot `slot` (a replacement reuses its
    dead predecessor's slot); `call(worker, unit)` submits a unit and returns its ObjectRef;
    `on_result(unit, result)` runs in the driver, in completion order; `describe(unit)` names a unit in
    errors."""
    from ray.exceptions import RayActorError, RayTaskError

    queue = deque(units)
    attempts: dict[int, int] = {}
    inflight: dict = {}  # ObjectRef -> (worker, slot, unit)

    def start(slot: int):
        stats.workers_started += 1
        return new_worker(slot)

    def submit(worker, slot: int) -> None:
        if queue:
            unit = queue.popleft()
            inflight[call(worker, unit)] = (worker, slot, unit)

    try:
        for slot in range(workers):
            submit(start(slot), slot)
        while inflight:
            [ref], _ = ray.wait(list(inflight), num_returns=1)
            worker, slot, unit = inflight.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as err:  # the worker process died: the unit returned nothing, redo it
                key = id(unit)
                attempts[key] = attempts.get(key, 0) + 1
                check(attempts[key] < MAX_ATTEMPTS,
                      f"{describe(unit)}: its Ray worker died {attempts[key]} times, the last time: "
                      f"{one_line(err)}")
                stats.retried_units += 1
                queue.appendleft(unit)
                ray.kill(worker, no_restart=True)
                submit(start(slot), slot)
                continue
            except RayTaskError as err:  # an error in kvtrim's code: the same as in one process
                cause = getattr(err, "cause", None)
                if isinstance(cause, KvtrimError):
                    raise KvtrimError(str(cause)) from None
                raise
            on_result(unit, result)
            submit(worker, slot)
    finally:
        for worker, _, _ in inflight.values():
            ray.kill(worker, no_restart=True)


__all__ = ["MAX_ATTEMPTS", "RayOptions", "RunStats", "add_ray_arguments", "ray_options", "connected",
           "worker_count", "prepare_worker", "run_units"]
