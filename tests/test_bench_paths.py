"""`kvtrim bench`'s tensor peak per user path: the reading (against allocations of known size) and the paths'
order on a tiny model (the deferred end holds every layer's whole prompt, the declared and `prompt_length=`
paths one layer at a time), as the benchmark's rows and report carry them."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from kvtrim.bench.memory import TensorPeak
from kvtrim.bench.paths import PATHS, path_peaks, run_path
from kvtrim.bench.report import path_table, path_targets
from kvtrim.bench.runner import BenchConfig, bench_methods, run_bench
from kvtrim.specs import parse_method_spec
from conftest import tiny_model

MIB = 2**20
N = 512


def test_tensor_peak_counts_what_is_held_at_once():
    with TensorPeak("cpu") as mem:
        a = torch.ones(2 * MIB // 4)  # 2 MiB
        b = torch.ones(3 * MIB // 4)  # 3 MiB: 5 held
        del a
        c = torch.ones(1 * MIB // 4)  # 4 held
        del b, c
        d = torch.ones(4 * MIB // 4)  # 4 held
        del d
    assert mem.reading.kind == "cpu-tensors"
    assert 5 * MIB <= mem.reading.peak_bytes < 5 * MIB + 64 * 1024


@pytest.fixture(scope="module")
def model():
    return kvtrim.enable(tiny_model("llama", layers=4, q_heads=4, kv_heads=2, head_dim=32))


def ids():
    return torch.randint(0, 256, (1, N), generator=torch.Generator().manual_seed(1))


def layer_bytes(n: int) -> int:
    return 2 * 2 * n * 32 * 4  # K and V, 2 KV heads, head_dim 32, float32


@pytest.mark.parametrize("spec", ["snapkv:compression_ratio=0.75", "h2o:compression_ratio=0.75",
                                  "tova:compression_ratio=0.75", "lagkv:compression_ratio=0.75:lag_size=32:sink_size=4"])
def test_the_deferred_end_holds_every_layer_the_declared_paths_one(model, spec):
    method = parse_method_spec(spec).build()
    peaks = path_peaks(model, method, ids())
    full = path_peaks(model, parse_method_spec("full").build(), ids())
    all_layers, kept = 4 * layer_bytes(N), 4 * layer_bytes(N // 4)
    # the deferred end: every layer holds its whole prompt until the first decode step, as the full cache
    assert peaks["generate_deferred"] >= all_layers and full["generate_deferred"] >= all_layers
    for path in ("prefill", "generate"):
        # one layer's prompt at a time: at most the full cache's peak less three layers' prompts (plus what is kept)
        assert peaks[path] <= full[path] - 3 * layer_bytes(N) + kept + layer_bytes(N) // 4, path
    # the paths keep the same entries
    kept_sets = [[layer.kept_positions() for layer in run_path(model, method, ids(), path).trim_layers()]
                 for path in PATHS]
    assert all(torch.equal(a, b) for other in kept_sets[1:] for a, b in zip(kept_sets[0], other))


def test_bench_rows_and_report_carry_the_path_peaks():
    model = kvtrim.enable(tiny_model("llama"))
    cfg = BenchConfig(methods=bench_methods("snapkv:compression_ratio=0.5,kvzip"), lengths=[96], compression_ratio=0.5, new_tokens=2,
                      repeats=2, trace_length=0, warmup=False, collect_garbage=False, same_size_decode=False)
    result = run_bench(model, None, cfg, progress=lambda s: None)
    first = [r for r in result["raw"] if r["repeat"] == 0 and r["status"] == "ok"]
    assert {r["method"] for r in first} == {"full", "snapkv:compression_ratio=0.5"}  # kvzip: no tokenizer, skipped
    assert all(r["path_peak_kind"] == "cpu-tensors" and r["path_peak_generate_deferred_bytes"] > 0 for r in first)
    assert all("path_peak_prefill_bytes" not in r for r in result["raw"] if r["repeat"] == 1)
    snap = next(s for s in result["summary"] if s["method"] == "snapkv:compression_ratio=0.5")
    # ratio mode: the deferred end holds every layer's prompt (as the full cache), the other paths do not
    assert snap["path_peak_generate_vs_full"] < 1 and snap["path_peak_generate_deferred_vs_full"] >= 1
    assert snap["layer_prompt_bytes"] == layer_bytes(96) // 2
    table = path_table(result)
    assert "| 96 | full |" in table and "| 96 | snapkv:compression_ratio=0.5 |" in table
    assert len(path_targets(result)) == 2
    off = run_bench(model, None, BenchConfig(**{**cfg.__dict__, "repeats": 1, "path_memory": False}),
                    progress=lambda s: None)
    assert all("path_peak_prefill_bytes" not in r for r in off["raw"]) and path_table(off).count("\n") == 1
