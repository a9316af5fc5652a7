"""`kvtrim bench --ray`: on a local one-node Ray cluster the lengths measured by a worker hold exactly
what a single-process run measures (every cell, stored bytes, generated tokens, the trace), timings
aside; bench refuses what would make timings share a device, before any work."""

from __future__ import annotations

import json

import pytest
import torch

ray = pytest.importorskip("ray")

from kvtrim.cli import main  # noqa: E402

# how long a cell took, and readings of the process's memory: not what the cell computed
TIMED = ("_s", "mem_", "kv_live_peak_bytes", "order")
ARGS = ["bench", "--threads", "1", "--model", "arch:tiny-llama", "--methods", "lagkv:lag_size=8:sink_size=4,streaming,h2o",
        "--lengths", "48,96", "--compression-ratio", "0.5", "--repeats", "1", "--max-new-tokens", "3",
        "--trace-length", "64", "--trace-decode", "3", "--no-plots", "--quiet"]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def _computed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(k.endswith(t) or k.startswith(t) for t in TIMED)}


def _run(args: list[str]) -> dict:
    threads = torch.get_num_threads()
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
    out = args[args.index("--out") + 1]
    return json.loads(open(f"{out}/bench.json", encoding="utf-8").read())


def test_ray_worker_measures_what_one_process_measures(cluster, tmp_path):
    alone = _run(ARGS + ["--out", str(tmp_path / "alone")])
    spread = _run(ARGS + ["--out", str(tmp_path / "ray"), "--ray", "--ray-cpus-per-worker", "1"])
    key = lambda row: (row["length"], row["method"], row["repeat"])  # noqa: E731
    assert sorted(map(key, spread["raw"])) == sorted(map(key, alone["raw"]))
    assert len(spread["raw"]) == 2 * 4  # 2 lengths x (3 methods + full), each once
    by_key = {key(row): _computed(row) for row in alone["raw"]}
    for row in spread["raw"]:
        assert _computed(row) == by_key[key(row)]
        assert row["status"] == "ok" and row["stored_bytes_prefill"] > 0
    assert spread["meta"]["complete"] and spread["meta"]["prompt_tokens"] == alone["meta"]["prompt_tokens"]
    strip = lambda trace: [{k: v for k, v in t.items() if not k.endswith("_s")} for t in trace]  # noqa: E731
    assert strip(spread["trace"]) == strip(alone["trace"]) and spread["trace"]
    assert {u["length"] for u in spread["meta"]["ray"]["units"]} == {48, 96}
    assert spread["meta"]["ray"]["workers_started"] == 1  # one node: one worker for both lengths
    assert [s["method"] for s in spread["summary"]] == [s["method"] for s in alone["summary"]]


def test_cpu_workers_never_share_a_node(cluster, tmp_path, capsys):
    out = tmp_path / "two"
    assert main(ARGS + ["--out", str(out), "--ray", "--ray-workers", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "one CPU worker per node" in err and "need 2 node(s), the cluster has 1" in err
    assert len(err.splitlines()) == 1 and not (out / "bench.json").exists()


@pytest.mark.parametrize("flags, message", [
    (["--ray", "--ray-gpus-per-worker", "0.5"], "must be 0 or a whole number, got 0.5"),
    (["--ray-workers", "2"], "--ray-workers needs --ray"),
    (["--ray", "--ray-cpus-per-worker", "0"], "--ray-cpus-per-worker must be > 0"),
    (["--ray", "--vs-kvpress"], "--ray runs the sweep, not --vs-kvpress"),
])
def test_bad_ray_flags_are_one_line_errors_before_any_work(tmp_path, capsys, flags, message):
    out = tmp_path / "bad"
    assert main(ARGS + ["--out", str(out)] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()  # checked before the output folder is created
