"""`kvtrim eval --ray`: on a local Ray cluster of 2 CPU workers the sweep writes exactly the rows of a
single-process run (same keys, predictions and scores), each once; a worker killed mid-sweep loses no
row and duplicates none; bad Ray flags are one-line errors before any work."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

ray = pytest.importorskip("ray")

import conftest  # noqa: E402
from conftest import tiny_model  # noqa: E402

from kvtrim.attention import enable  # noqa: E402
from kvtrim.cli import main  # noqa: E402
from kvtrim.eval.prompt import PromptFormat  # noqa: E402
from kvtrim.eval.ray_sweep import RayOptions, RaySweep  # noqa: E402
from kvtrim.eval.runner import RESULTS, Runner, RunSettings, plan  # noqa: E402
from kvtrim.eval.tasks import generate_samples  # noqa: E402
from kvtrim.methods.base import KvtrimError  # noqa: E402
from kvtrim.specs import parse_method_specs  # noqa: E402

TIMING = ("seconds", "prefill_reused", "kvzip_scores_shared", "context_group")  # how a row was computed, not what it holds
SETTINGS = RunSettings(model="tiny", max_new_tokens=4, stop_when_answered=False)


class TinyLoader:
    """What a worker calls to get `(model, tokenizer)`: the tiny random Llama (same seed, same weights in
    every process) with SmolLM2's tokenizer. With `die_after_rows`, the first worker to load (of all
    workers, ever) exits at its first forward after the driver has written a row: a worker killed
    mid-sweep, in the middle of a unit."""

    def __init__(self, die_after_rows: str | None = None):
        self.die_after_rows = die_after_rows

    def __call__(self):
        from transformers import AutoTokenizer

        from kvtrim.models import resolve_model_dir

        model = enable(tiny_model("llama", vocab=49152, layers=2))
        if self.die_after_rows is not None and _claim(os.path.join(self.die_after_rows, "victim")):
            results = os.path.join(self.die_after_rows, RESULTS)

            def die_once_rows_exist(module, args):
                if os.path.exists(results) and os.path.getsize(results) > 0:
                    os._exit(1)  # no cleanup, no exception: what a killed process looks like to Ray

            model.register_forward_pre_hook(die_once_rows_exist)
        return model, AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))


def _claim(path: str) -> bool:
    """True for exactly one caller across processes (atomic create)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


@pytest.fixture(scope="module")
def cluster():
    # the workers unpickle TinyLoader; this module and conftest are not importable there, so send them by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(conftest)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def jobs():
    _, tok = TinyLoader()()
    fmt = PromptFormat(tok)
    samples = (generate_samples("niah_single_1", fmt, 300, 2, seed=1)
               + generate_samples("passkey", fmt, 300, 2, seed=1, depths=(0.5,)))
    specs = parse_method_specs(["full", "streaming", "lagkv:sink_size=4:lag_size=16"])
    return plan(samples, specs, [0.5, 0.75])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, jobs):
    """The rows of the same sweep in one process."""
    model, tok = TinyLoader()()
    return Runner(model, tok, SETTINGS, str(tmp_path_factory.mktemp("single")), progress=False).run(jobs)


def _content(rows: list[dict]) -> dict[str, dict]:
    keys = [row["key"] for row in rows]
    assert len(keys) == len(set(keys)), "a key written twice"
    return {row["key"]: {k: v for k, v in row.items() if k not in TIMING} for row in rows}


def _file_rows(out) -> list[dict]:
    with open(os.path.join(out, RESULTS), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_two_workers_write_the_single_process_rows(cluster, jobs, reference, tmp_path):
    sweep = RaySweep(TinyLoader(), SETTINGS, str(tmp_path), RayOptions(workers=2), progress=False)
    rows = sweep.run(jobs)
    assert len(reference) == len(jobs)
    assert _content(rows) == _content(reference)
    assert _content(_file_rows(tmp_path)) == _content(reference)
    assert sweep.workers_started == 2 and sweep.retried_units == 0
    assert sweep.rows_written == len(jobs)


def test_a_worker_killed_mid_sweep_loses_and_duplicates_nothing(cluster, jobs, reference, tmp_path):
    sweep = RaySweep(TinyLoader(die_after_rows=str(tmp_path)), SETTINGS, str(tmp_path), RayOptions(workers=2),
                     progress=False)
    rows = sweep.run(jobs)
    assert os.path.exists(tmp_path / "victim")
    assert sweep.retried_units == 1 and sweep.workers_started == 3  # the dead worker was replaced
    assert _content(_file_rows(tmp_path)) == _content(rows) == _content(reference)


def test_resume_runs_only_the_missing_rows(cluster, jobs, reference, tmp_path):
    # a previous run that wrote the first sample's rows and was cut in the middle of a line
    first = [row for row in reference if row["sample_id"] == jobs[0].sample.id]
    model, tok = TinyLoader()()
    Runner(model, tok, SETTINGS, str(tmp_path), progress=False).run(jobs[: len(first)])
    with open(tmp_path / RESULTS, "a", encoding="utf-8") as f:
        f.write('{"key": "cut')
    sweep = RaySweep(TinyLoader(), SETTINGS, str(tmp_path), RayOptions(workers=2), progress=False)
    rows = sweep.run(jobs)
    assert sweep.rows_written == len(jobs) - len(first)
    assert _content(rows) == _content(reference)


def test_a_kvtrim_error_in_a_worker_is_the_same_one_line_error(cluster, jobs, tmp_path):
    # a sample asking for more tokens than the tiny model's context: refused in the worker, at its unit
    job = jobs[0]
    too_long = dataclasses.replace(job, sample=dataclasses.replace(job.sample, max_new_tokens=10_000))
    uncapped = RunSettings(model="tiny", stop_when_answered=False)
    sweep = RaySweep(TinyLoader(), uncapped, str(tmp_path), RayOptions(workers=1), progress=False)
    with pytest.raises(KvtrimError, match="beyond the model's context"):
        sweep.run([too_long])


def test_more_workers_than_the_cluster_fits_is_an_error(cluster, jobs, tmp_path):
    sweep = RaySweep(TinyLoader(), SETTINGS, str(tmp_path), RayOptions(workers=3), progress=False)
    with pytest.raises(KvtrimError, match="do not fit"):
        sweep.run(jobs)
    assert not os.path.exists(tmp_path / RESULTS) or os.path.getsize(tmp_path / RESULTS) == 0


BASE = ["eval", "--tasks", "passkey", "--lengths", "300", "--samples", "1", "--methods", "full", "--no-plots", "--quiet"]


@pytest.mark.parametrize("extra, message", [
    (["--ray-workers", "2"], "--ray-workers needs --ray"),
    (["--ray-cpus-per-worker", "1"], "--ray-cpus-per-worker needs --ray"),
    (["--ray", "--ray-workers", "0"], "--ray-workers must be >= 1"),
    (["--ray", "--ray-cpus-per-worker", "0"], "--ray-cpus-per-worker must be > 0"),
    (["--ray", "--ray-gpus-per-worker", "-1"], "--ray-gpus-per-worker must be >= 0"),
])
def test_bad_ray_flags_are_one_line_errors(extra, message, tmp_path, capsys):
    assert main(BASE + ["--out", str(tmp_path / "out")] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_ray_not_installed_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # find_spec reports a module set to None as missing
    assert main(BASE + ["--out", str(tmp_path / "out"), "--ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert "kvtrim[ray]" in err and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "out" / RESULTS)


def test_torch_threads_unchanged_in_the_driver(cluster, jobs, tmp_path):
    # the workers set their own thread count; the driver's stays what the user had
    before = torch.get_num_threads()
    RaySweep(TinyLoader(), SETTINGS, str(tmp_path), RayOptions(workers=1), progress=False).run(jobs[:1])
    assert torch.get_num_threads() == before


def test_batched_units_write_the_single_process_rows(cluster, jobs, reference, tmp_path):
    """`--batch-size 2 --ray`: a unit holds two samples' jobs (run in batches in the worker); same rows."""
    from kvtrim.eval.runner import pending_units

    batched = dataclasses.replace(SETTINGS, batch_size=2)
    assert [len({job.sample.id for job in unit}) for unit in pending_units(str(tmp_path), jobs, 2)] == [2, 2]
    sweep = RaySweep(TinyLoader(), batched, str(tmp_path), RayOptions(workers=2), progress=False)
    rows = [{k: v for k, v in row.items() if k != "batch_size"} for row in sweep.run(jobs)]
    assert _content(rows) == _content(reference)
    assert sweep.rows_written == len(jobs)
