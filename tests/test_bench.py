"""The benchmark's measurement plumbing, on tiny random models. No timing assertions: clocks are faked
where time matters, and only bookkeeping (what is counted where, bytes, medians, schema) is checked."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from kvtrim.bench.memory import PeakMemory
from kvtrim.bench.runner import BenchConfig, bench_methods, kv_peak_layer_sum, measure_cell, run_bench
from kvtrim.specs import parse_method_spec as parse_spec
from kvtrim.bench.summary import read_json, summarize, validate_result, write_json
from kvtrim.bench.timing import EvictionTimer
from kvtrim.cache import TrimCache
from kvtrim.methods import KeyDiff, LagKV, StreamingLLM
from kvtrim.methods.base import EvictionMethod, KvtrimError, span
from kvtrim.prefill import prefill
from conftest import tiny_model


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@dataclass
class ClockedKeepLast(EvictionMethod):
    """Keeps the last `budget` entries; each hook call advances the fake clock by `score_cost`, each
    gather (through `gather_state`) by `gather_cost`."""

    budget: int = 8
    score_cost: float = 1.0
    gather_cost: float = 0.25
    clock: FakeClock | None = None

    def on_update(self, view):
        self.clock.t += self.score_cost
        n = view.stored
        return None if n <= self.budget else span(n - self.budget, n, view.keys)

    def gather_state(self, state, keep):
        self.clock.t += self.gather_cost
        return state


def test_timer_counts_only_eviction_work_per_phase():
    model = tiny_model("llama", layers=2)
    clock = FakeClock()
    # the model's own compute "costs" 100 per layer forward: none of it may show up as eviction time
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda *a: setattr(clock, "t", clock.t + 100.0))
    timer = EvictionTimer("cpu", clock=clock)
    method = ClockedKeepLast(budget=8, clock=clock)
    cache = timer.attach(TrimCache(timer.instrument(method), config=model.config))
    ids = torch.randint(0, 200, (1, 20))
    with torch.no_grad():
        logits = prefill(model, ids, cache, chunk_size=5)  # 4 forwards x 2 layers
        timer.phase = "decode"
        for i in range(3):
            model(input_ids=logits.argmax(-1, keepdim=True), cache=cache, position_ids=torch.tensor([[20 + i]]))
    t = timer.totals()
    # prefill: 8 hook calls; evictions once the 8-entry budget overflows (forwards 2, 3, 4) in 2 layers
    assert t["prefill_score_s"] == 8 * 1.0
    assert t["prefill_gather_s"] == 6 * 0.25
    assert t["prefill_evict_s"] == t["prefill_score_s"] + t["prefill_gather_s"]
    assert t["decode_score_s"] == 6 * 1.0 and t["decode_gather_s"] == 6 * 0.25
    assert timer.evictions == {"prefill": 6, "decode": 6}
    assert timer.calls[("prefill", "score")] == 8 and timer.calls[("decode", "gather")] == 6
    assert clock.t == 7 * 2 * 100.0 + t["prefill_evict_s"] + t["decode_evict_s"]
    # the user's method object is untouched (only the benchmark's copy is wrapped)
    assert "on_update" not in vars(method)


def test_live_peak_follows_entries_held_at_once():
    model = tiny_model("llama", layers=3)
    timer = EvictionTimer("cpu")
    cache = timer.attach(TrimCache(timer.instrument(StreamingLLM(budget=10, sink_size=2)), config=model.config))
    with torch.no_grad():
        prefill(model, torch.randint(0, 200, (1, 30)), cache)
    per_entry = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head_dim 16, float32
    # one-shot prefill, attend then evict: layer i holds 30 entries while layers < i already hold 10
    assert timer.live_peak_bytes == (10 + 10 + 30) * per_entry
    assert kv_peak_layer_sum(cache) == 3 * 30 * per_entry
    assert cache.stats().bytes_stored == 3 * 10 * per_entry


def test_stored_bytes_are_cache_stats():
    model = tiny_model("qwen2", q_heads=6, kv_heads=2)
    cfg = BenchConfig(methods=[], compression_ratio=0.5, new_tokens=6, collect_garbage=False)
    spec = parse_spec("keydiff:block_size=16")
    ids = torch.randint(0, 200, (1, 64))
    row, cache = measure_cell(model, spec, ids, cfg, 64, return_cache=True)
    stats = cache.stats()
    assert row["status"] == "ok"
    assert row["stored_bytes_end"] == stats.bytes_stored and row["full_bytes_end"] == stats.bytes_full
    assert row["bookkeeping_bytes_end"] == stats.bytes_bookkeeping
    assert row["kv_peak_layer_sum_bytes"] == kv_peak_layer_sum(cache)
    # the prefill snapshot equals the stats of the same prefill done by hand
    again = TrimCache(KeyDiff(budget=32, block_size=16), config=model.config)
    with torch.no_grad():
        prefill(model, ids, again)
    assert row["stored_bytes_prefill"] == again.stats().bytes_stored
    assert row["full_bytes_prefill"] == again.stats().bytes_full
    assert row["prefill_evictions"] == 2 * 2  # blocks 3 and 4 overflow the 32-entry budget, in 2 layers
    assert row["method_repr"] == KeyDiff(budget=32, block_size=16).describe()


def _row(method, repeat, prefill_s, decode_s, stored, evict=0.0, length=100):
    return {"method": method, "length": length, "prompt_tokens": length, "repeat": repeat, "status": "ok",
            "prefill_s": prefill_s, "prefill_evict_s": evict, "prefill_score_s": evict, "prefill_gather_s": 0.0,
            "decode_s": decode_s, "decode_tokens": 10, "decode_evict_s": 0.0, "prefill_evictions": 1,
            "decode_evictions": 0, "stored_bytes_prefill": stored, "full_bytes_prefill": 1000,
            "stored_bytes_end": stored, "full_bytes_end": 1000, "kv_peak_layer_sum_bytes": 1000,
            "kv_live_peak_bytes": 1000, "mem_peak_prefill_bytes": 10, "mem_peak_bytes": 20}


def test_summary_medians_and_paired_ratios():
    raw = [
        _row("full", 0, 2.0, 1.0, 1000), _row("m", 0, 3.0, 0.5, 250, evict=0.3),
        _row("full", 1, 4.0, 2.0, 1000), _row("m", 1, 4.0, 1.0, 250, evict=0.2),
        _row("full", 2, 10.0, 1.0, 1000), _row("m", 2, 5.0, 0.25, 250, evict=1.0),
        {"method": "x", "length": 100, "repeat": 0, "status": "skipped", "reason": "too short"},
    ]
    s = {r["method"]: r for r in summarize(raw, compression_ratio=0.75)}
    m = s["m"]
    assert m["repeats"] == 3 and m["prefill_s"] == 4.0 and m["decode_s"] == 0.5
    # paired ratios: 3/2, 4/4, 5/10 -> median 1.0 (the ratio of medians would be 4/4 too, but decode differs)
    assert m["prefill_vs_full"] == 1.0
    # decode tok/s per repeat: m 20, 10, 40; full 10, 5, 10 -> ratios 2, 2, 4 -> 2
    assert m["decode_tps"] == 20.0 and m["decode_tps_vs_full"] == 2.0
    # eviction share per row: 0.1, 0.05, 0.2 -> 0.1
    assert m["evict_share_prefill"] == pytest.approx(0.1)
    assert m["stored_vs_full"] == 0.25 and m["stored_vs_ideal"] == 0.0
    assert s["full"]["prefill_vs_full"] == 1.0 and s["full"]["stored_vs_ideal"] is None
    assert s["x"]["status"] == "skipped" and s["x"]["reason"] == "too short" and s["x"]["repeats"] == 0


def test_summary_ratio_needs_the_same_repeat():
    raw = [_row("full", 0, 2.0, 1.0, 1000), _row("m", 1, 3.0, 0.5, 250)]
    m = {r["method"]: r for r in summarize(raw)}["m"]
    assert m["prefill_vs_full"] is None and m["prefill_s"] == 3.0


def test_specs_build_at_budget_or_as_given():
    spec = parse_spec("lagkv:sink_size=4:lag_size=16")
    method = spec.build(400, 0.5)
    assert isinstance(method, LagKV) and method.mode == "reference" and method.sink_size == 4
    fixed = parse_spec("keydiff:budget=64")
    assert fixed.fixes_size and fixed.build(4000, 0.75).budget == 64
    assert parse_spec("keydiff").build(400, 0.75).budget == 100
    assert parse_spec("lagkv:skip_layers=0+1").build(400, 0.5).skip_layers == (0, 1)
    specs = bench_methods("streaming,keydiff")
    assert [s.label for s in specs] == ["full", "streaming", "keydiff"]
    with pytest.raises(KvtrimError, match="unknown method"):
        parse_spec("nope")
    with pytest.raises(KvtrimError, match="has no parameter"):
        parse_spec("keydiff:window=3")
    with pytest.raises(KvtrimError, match="cannot read"):
        parse_spec("keydiff:budget=many")
    with pytest.raises(KvtrimError, match="listed twice"):
        bench_methods("keydiff,keydiff")
    with pytest.raises(KvtrimError, match="out of reach"):
        parse_spec("lagkv").build(300, 0.75)


def test_unreachable_cells_are_skipped_with_the_reason():
    model = tiny_model("llama")
    cfg = BenchConfig(methods=[], compression_ratio=0.75, new_tokens=2, collect_garbage=False)
    row = measure_cell(model, parse_spec("lagkv"), torch.randint(0, 200, (1, 40)), cfg, 40)
    assert row["status"] == "skipped" and "does not compress 40 tokens" in row["reason"]


def test_run_bench_result_schema_and_json_round_trip(tmp_path):
    model = tiny_model("llama")
    cfg = BenchConfig(methods=bench_methods("lagkv:lag_size=8:sink_size=2,keydiff:block_size=16"),
                      lengths=[48, 96], compression_ratio=0.5, new_tokens=3, repeats=2, trace_length=64,
                      trace_decode=4, warmup=False, collect_garbage=False)
    result = run_bench(model, None, cfg, progress=lambda s: None)
    assert validate_result(result) == []
    assert result["schema"] == "kvtrim.bench/1"
    assert len(result["raw"]) == 2 * 2 * 3  # repeats x lengths x methods (full added)
    # interleaving: every round holds each method once, the order rotating
    first = [r["method"] for r in result["raw"] if r["repeat"] == 0 and r["length"] == 48]
    second = [r["method"] for r in result["raw"] if r["repeat"] == 1 and r["length"] == 48]
    assert sorted(first) == sorted(second) and first != second and first[1:] == second[:-1]
    assert {(s["method"], s["length"]) for s in result["summary"]} == {
        (m, n) for m in ("full", "lagkv:lag_size=8:sink_size=2", "keydiff:block_size=16") for n in (48, 96)}
    trace = {t["method"]: t for t in result["trace"]}
    assert trace["keydiff:block_size=16"]["schedule"] == "blocks of 16"
    assert trace["lagkv:lag_size=8:sink_size=2"]["schedule"] == "lagkv chunks"
    points = trace["full"]["points"]
    assert points[-1][0] == 64 + 4 and all(p[1] == p[2] for p in points)  # full: stored == full
    entry = 2 * 2 * 16 * 4  # bytes of one entry of a layer: K and V, 2 KV heads, head_dim 16, float32
    kd = trace["keydiff:block_size=16"]["points"][:4]  # after each prefill block: at most the budget (32)
    assert [p[1] for p in kd] == [16 * entry * 2, 32 * entry * 2, 32 * entry * 2, 32 * entry * 2]
    path = write_json(result, tmp_path / "b.json")
    assert read_json(path)["raw"] == json.loads(json.dumps(result["raw"]))
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    with pytest.raises(KvtrimError, match="not a kvtrim bench result"):
        read_json(bad)


def test_peak_memory_sees_torch_allocations():
    with PeakMemory("cpu") as mem:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        del block
    assert mem.reading.kind in ("rss-hwm", "rss-sampled")
    if mem.reading.kind == "rss-hwm":  # the kernel's own high-water mark: exact up to page rounding
        assert mem.reading.peak_bytes >= 60 * 2**20


# ---- kvpress comparison: the pure parts ----------------------------------------------------------------
def test_jaccard_and_per_head():
    from kvtrim.bench.kvpress_compare import jaccard, jaccard_per_head

    assert jaccard([1, 2, 3], [2, 3, 4]) == 0.5
    assert jaccard([], []) == 1.0 and jaccard([1], []) == 0.0
    assert jaccard_per_head([[[1, 2], [3]], [[0]]], [[[1, 2], [4]], [[0]]]) == [[1.0, 0.0], [1.0]]
    with pytest.raises(KvtrimError, match="layer counts differ"):
        jaccard_per_head([[[1]]], [])


def test_compare_rows_from_hand_made_sides():
    from kvtrim.bench.kvpress_compare import PAIR_BY_NAME, compare, markdown

    prompts = [{"id": "s", "role": "selection", "length": 10, "ids": list(range(10))},
               {"id": "p0", "role": "passkey", "length": 10, "ids": [1], "key": "42"},
               {"id": "p1", "role": "passkey", "length": 10, "ids": [2], "key": "7"}]
    pairs = [PAIR_BY_NAME["full"], PAIR_BY_NAME["streaming"]]
    ours = {"kept": {"full@s": [[list(range(10))]], "streaming@s": [[[0, 1, 8, 9]]]},
            "timings": [{"press": "full", "prompt": "s", "prefill_s": 2.0, "compress_s": 0.0},
                        {"press": "streaming", "prompt": "s", "prefill_s": 2.2, "compress_s": 0.01},
                        {"press": "streaming", "prompt": "s", "prefill_s": 2.6, "compress_s": 0.03}],
            "answers": [{"press": "full", "prompt": "p0", "tokens": [4, 2]}, {"press": "full", "prompt": "p1", "tokens": [7]},
                        {"press": "streaming", "prompt": "p0", "tokens": [4, 2]},
                        {"press": "streaming", "prompt": "p1", "tokens": [1]}]}
    theirs = {"kept": {"full@s": [[list(range(10))]], "streaming@s": [[[0, 1, 7, 8]]]},
              "timings": [{"press": "full", "prompt": "s", "prefill_s": 3.0, "compress_s": 0.0},
                          {"press": "streaming", "prompt": "s", "prefill_s": 3.3, "compress_s": 0.02}],
              "answers": [{"press": "full", "prompt": "p0", "tokens": [4, 2]}, {"press": "full", "prompt": "p1", "tokens": [7]},
                          {"press": "streaming", "prompt": "p0", "tokens": [9]},
                          {"press": "streaming", "prompt": "p1", "tokens": [1]}]}
    mib = 2**20
    ours["peaks"] = [{"press": "full", "prompt": "s", "prefill": 8 * mib, "generate": 8 * mib, "generate_deferred": 8 * mib},
                     {"press": "streaming", "prompt": "s", "prefill": 4 * mib, "generate": 5 * mib,
                      "generate_deferred": 8 * mib}]
    theirs["peaks"] = [{"press": "full", "prompt": "s", "peak_bytes": 10 * mib},
                       {"press": "streaming", "prompt": "s", "peak_bytes": 6 * mib}]
    rows = {r["method"]: r for r in compare(prompts, pairs, ours, theirs, lambda ids: "".join(map(str, ids)))}
    s = rows["streaming"]
    assert s["kvpress_peak_bytes"] == 6 * mib and s["kvtrim_peak_generate_bytes"] == 5 * mib
    assert s["jaccard_mean"] == 3 / 5 and s["heads_identical"] == 0.0
    assert rows["full"]["jaccard_mean"] == 1.0 and rows["full"]["heads_identical"] == 1.0
    assert s["kvtrim_prefill_s"] == pytest.approx(2.4) and s["kvtrim_compress_s"] == pytest.approx(0.02)
    assert s["kvpress_prefill_s"] == 3.3
    assert s["kvtrim_full_prefill_s"] == 2.0 and s["kvpress_full_prefill_s"] == 3.0
    assert (s["passkey_kvtrim"], s["passkey_kvpress"], s["answers_identical"], s["passkey_trials"]) == (1, 0, 1, 2)
    assert (rows["full"]["passkey_kvtrim"], rows["full"]["answers_identical"]) == (2, 2)
    md = markdown({"meta": {"command": "kvtrim bench --vs-kvpress", "model": "m", "compression_ratio": 0.75, "repeats": 1,
                            "threads": 2, "seed": 0, "new_tokens": 8,
                            "kvtrim_env": {"kvtrim": "0", "transformers": "5", "torch": "2"},
                            "kvpress_env": {"kvpress": "0.5.5", "transformers": "4"}}, "rows": list(rows.values())})
    assert "| 10 | streaming (StreamingLLMPress(n_sink=4)) | 0.6000 (0.600) | 0 % |" in md
    assert "| 10 | streaming | 6 (0.60) | 4 (0.50) | 5 (0.62) | 8 (1.00) |" in md  # each side x its own full


def test_kvtrim_counterparts_are_the_documented_modes():
    from kvtrim.bench.kvpress_compare import PAIR_BY_NAME

    assert PAIR_BY_NAME["lagkv"].kvtrim_method(4096, 0.75) == LagKV(compression_ratio=0.75, sink_size=4, lag_size=128)
    assert PAIR_BY_NAME["keydiff"].kvtrim_method(4096, 0.75) == KeyDiff(compression_ratio=0.75)
    assert PAIR_BY_NAME["block_keydiff"].kvtrim_method(4096, 0.75) == KeyDiff(budget=1024, block_size=128)
    snap = PAIR_BY_NAME["snapkv"].kvtrim_method(4096, 0.75)
    assert (snap.window, snap.kernel, snap.pooling, snap.compression_ratio) == (64, 5, "avg", 0.75)
    assert PAIR_BY_NAME["streaming"].kvtrim_method(4096, 0.75) == StreamingLLM(compression_ratio=0.75, sink_size=4)


def test_kvpress_runner_recovers_kept_rows():
    """The runner's key matching (the runner lives in the kvpress venv; this helper is plain torch)."""
    import importlib.util
    import pathlib

    import kvtrim.bench

    path = pathlib.Path(kvtrim.bench.__file__).resolve().with_name("kvpress_side.py")
    spec = importlib.util.spec_from_file_location("kvpress_side", path)
    side = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(side)  # imports kvpress only when a press is built
    full = torch.randn(50, 8)
    keep = torch.tensor([0, 3, 9, 31, 49])
    assert side.match_rows(full, full[keep]) == [0, 3, 9, 31, 49]
    with pytest.raises(RuntimeError, match="no exact match"):
        side.match_rows(full, torch.randn(2, 8))
    # its peak measurement is kvtrim's own, loaded from the file next to it (no kvtrim import there)
    peak = side.tensor_peak()
    with peak("cpu") as mem:
        block = torch.ones(2**20)
        del block
    assert mem.reading.kind == "cpu-tensors" and mem.reading.peak_bytes >= 4 * 2**20


# ---- report and CLI -----------------------------------------------------------------------------------
def test_cli_writes_json_plots_and_report(tmp_path, capsys):
    from kvtrim.bench.report import write_readme
    from kvtrim.cli import main

    out = tmp_path / "b"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--threads", "1", "--model", "arch:tiny-llama", "--methods",
                   "keydiff:block_size=16,keydiff:budget=24:block_size=16", "--lengths", "48,96", "--compression-ratio", "0.5", "--repeats", "1", "--max-new-tokens", "3",
                   "--trace-length", "64", "--trace-decode", "3", "--no-warmup", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    result = read_json(out / "bench.json")
    assert validate_result(result) == [] and result["meta"]["command"].startswith("kvtrim ")
    assert result["meta"]["model"]["weights"] == "random"
    for name in ("prefill", "decode", "memory", "stored"):
        assert (out / f"bench_{name}.png").stat().st_size > 1000
    readme = write_readme(out, plots=False).read_text()
    details = (out / "DETAILS.md").read_text()
    assert "| 48 | full |" in details and "![bench_stored](bench_stored.png)" in details
    assert "| `keydiff:budget=24:block_size=16` |" in readme
    assert "KeyDiff block-wise prefill, fixed budget" in readme  # the flat-peak target is evaluated
    assert main(["bench", "--methods", "nope", "--out", str(out)]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_flat_peak_target_is_checked_per_configuration_across_lengths():
    """Two fixed-budget KeyDiff configurations at one length are not a length sweep; each configuration
    measured at several lengths gets its own flat-peak verdict."""
    from kvtrim.bench.report import targets

    def cell(method, length, kv_peak):
        return {"status": "ok", "method": method, "length": length, "prompt_tokens": length - 10,
                "kv_live_peak_bytes": kv_peak, "mem_peak_prefill_bytes": kv_peak, "peak_per_layer": [0, 64],
                "evict_share_prefill": 0.01, "prefill_evictions": 3, "decode_tps_vs_full": 1.5, "stored_vs_ideal": 0.0}

    meta = {"config": {"new_tokens": 4}}
    same_length = {"meta": meta, "summary": [cell("keydiff:budget=8", 256, 100), cell("keydiff:budget=8:block_size=32", 256, 200)]}
    assert not [t for t in targets(same_length) if "flat" in t or "fixed budget" in t]

    sweep = {"meta": meta, "summary": [cell("keydiff:budget=8", 256, 100), cell("keydiff:budget=8", 512, 100),
                                       cell("keydiff:budget=8", 1024, 100), cell("keydiff:budget=16", 256, 100),
                                       cell("keydiff:budget=16", 512, 150), cell("keydiff:budget=16", 1024, 300)]}
    verdicts = {t.split("`")[1]: t[2] for t in targets(sweep) if "fixed budget" in t}
    assert verdicts == {"keydiff:budget=8": "✅", "keydiff:budget=16": "❌"}


# ---- the physical limit: a full cache of the method's stored size, decoded in the same cell ----------------
def test_same_size_decode_runs_a_full_cache_of_the_stored_size(monkeypatch):
    """Each evicting cell decodes three times: a copy of the method's cache without the eviction timer (the
    step compared with the physical limit), the method's cache with it (shares, memory), then a full cache
    holding per layer the entries the method held after the prompt. A fake clock (one unit per model
    forward) shows which forwards each timing covers; a pre-hook shows which cache each decode step ran on."""
    import kvtrim.bench.runner as runner
    from kvtrim.methods.full import FullCache

    model = tiny_model("llama", layers=2)
    clock = FakeClock()
    monkeypatch.setattr(runner.time, "perf_counter", clock)
    seen = []  # (method class, stored per layer) at every single-token forward

    def pre_hook(module, args, kwargs):
        clock.t += 1.0
        cache = kwargs.get("cache")
        if kwargs["input_ids"].shape[-1] == 1:
            seen.append((type(cache.method), [layer.stored for layer in cache.trim_layers()]))

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    cfg = BenchConfig(methods=[], compression_ratio=0.5, new_tokens=5, collect_garbage=False)
    ids = torch.randint(0, 200, (1, 64))
    row, cache = measure_cell(model, parse_spec("streaming:budget=20"), ids, cfg, 64, return_cache=True)
    row_with_copy = row
    assert row["decode_untimed_s"] == 5.0 and row["decode_s"] == 5.0 and row["decode_same_size_full_s"] == 5.0
    untimed_steps, method_steps, full_steps = seen[:5], seen[5:10], seen[10:]
    assert all(kind is not FullCache for kind, _ in untimed_steps + method_steps) and len(full_steps) == 5
    assert untimed_steps == method_steps  # the copy starts where the method's cache stood after the prompt
    assert row["decode_evictions"] == 5 * 2  # one per step and layer, of the timed decode only
    assert all(kind is FullCache for kind, _ in full_steps)
    # the reference starts where the method stood after the prompt, and grows by one per step
    assert full_steps[0][1] == [20, 20] and full_steps[-1][1] == [24, 24]
    assert row["stored_per_layer_prefill"] == [20, 20]
    assert cache.stats().stored_per_layer == [20, 20]  # the method's own cache is untouched by it

    seen.clear()
    row = measure_cell(model, parse_spec("full"), ids, cfg, 64)
    assert row["decode_same_size_full_s"] is None and row["decode_untimed_s"] is None  # its own reference
    assert len(seen) == 5
    off = BenchConfig(methods=[], compression_ratio=0.5, new_tokens=5, collect_garbage=False, same_size_decode=False)
    plain = measure_cell(model, parse_spec("streaming:budget=20"), ids, off, 64)
    assert plain["decode_same_size_full_s"] is None and plain["decode_untimed_s"] is None
    # the untimed copy's evictions (it decodes while the timer is still in its prefill phase) are not counted
    assert plain["prefill_evictions"] == row_with_copy["prefill_evictions"]
    assert plain["prefill_evict_s"] == row_with_copy["prefill_evict_s"]


def test_same_size_full_cache_copies_shapes_and_dtypes_per_layer():
    from kvtrim.bench.runner import same_size_full_cache, stored_shapes

    model = tiny_model("qwen2", q_heads=6, kv_heads=2, layers=3)
    cache = TrimCache(LagKV(lag_size=8, sink_size=2, skip_layers=(1,)), config=model.config)
    with torch.no_grad():
        prefill(model, torch.randint(0, 200, (1, 50)), cache)
    shapes = stored_shapes(cache)
    full = same_size_full_cache(model, shapes)
    assert [layer.stored for layer in full.trim_layers()] == [layer.stored for layer in cache.trim_layers()]
    assert full.trim_layers()[1].stored == 50 and full.trim_layers()[0].stored < 50  # skip_layers stay full
    assert full.prompt_ended and all(layer.keys.dtype == torch.float32 for layer in full.trim_layers())
    assert all(s[0].device.type == "meta" for s in shapes.values())  # no copy of the KV is held


def test_decode_ratio_to_the_same_size_full_cache_and_its_report():
    from kvtrim.bench.report import decode_table, headline_table, targets

    raw = []
    for rep, (method_s, same_s) in enumerate([(1.0, 0.8), (1.2, 1.0), (0.9, 0.9)]):
        raw.append(_row("full", rep, 2.0, 1.5, 1000))
        m = _row("h2o", rep, 2.0, method_s, 250, evict=0.01)
        m.update(decode_same_size_full_s=same_s, decode_evict_s=0.1 * method_s, decode_evictions=10)
        raw.append(m)
    summary = summarize(raw, compression_ratio=0.75)
    h2o = {r["method"]: r for r in summary}["h2o"]
    # per repeat: 1.25, 1.2, 1.0 -> median 1.2 (paired within the cell); the eviction share 0.1 each
    assert h2o["decode_step_vs_same_size"] == pytest.approx(1.2)
    assert h2o["evict_share_decode"] == pytest.approx(0.1)
    assert {r["method"]: r for r in summary}["full"]["decode_step_vs_same_size"] is None
    h2o["stored_per_layer_prefill"] = [25, 25]
    result = {"meta": {"config": {"new_tokens": 10}}, "summary": summary}
    table = decode_table(result)
    # step 100 ms; the same-size full cache 90 ms a step (median 0.9 s / 10 tokens), ratio 1.20; eviction 10 ms (10 %)
    assert "| 100 | h2o | 25 | 100.0 | 90.0 (1.20) | 10.00 (10.0 %) | 10 |" in table
    assert "| `h2o` | 0.50 % | 10.00 % |" in headline_table(result)
    assert "1.20 × the step of a full cache of the same size" in "\n".join(targets(result))
    assert any(t.startswith("- ❌ decode step of `h2o`") for t in targets(result))


def test_the_ratio_to_the_same_size_full_cache_reads_the_untimed_decode_when_there_is_one():
    from kvtrim.bench.summary import derive

    row = _row("h2o", 0, 2.0, 1.2, 250, evict=0.01)
    row.update(decode_same_size_full_s=1.0, decode_evict_s=0.1, decode_evictions=10)
    assert derive(row)["decode_step_vs_same_size"] == pytest.approx(1.2)  # older results: the timed decode
    row["decode_untimed_s"] = 1.1
    out = derive(row)
    assert out["decode_step_vs_same_size"] == pytest.approx(1.1)
    assert out["decode_step_s"] == pytest.approx(1.2 / row["decode_tokens"])  # the rest stays on the timed run
    assert out["evict_share_decode"] == pytest.approx(0.1 / 1.2)


def test_results_written_before_the_same_size_decode_still_validate():
    raw = [_row("full", 0, 2.0, 1.0, 1000), _row("m", 0, 3.0, 0.5, 250)]
    result = {"schema": "kvtrim.bench/1", "meta": {}, "raw": raw, "summary": summarize(raw), "trace": []}
    for s in result["summary"]:
        del s["decode_same_size_full_s"], s["decode_step_vs_same_size"]
    assert validate_result(result) == []


# ---- scoring passes: the compression cost of any method that has them ------------------------------------
@dataclass
class ClockedPasses(EvictionMethod):
    """A user-defined method with scoring passes (no tokenizer needed): `passes` forwards of the prompt's
    first 4 tokens; each layer's hook in a pass advances the fake clock by `pass_cost`; keeps the last
    `budget` entries when the prompt ends."""

    needs_queries = True
    scoring_passes = True

    budget: int = 8
    passes: int = 3
    pass_cost: float = 2.0
    clock: FakeClock | None = None

    def scoring_inputs(self, context_ids, tokenizer):
        return [(context_ids[:, :4], i) for i in range(self.passes)]

    def new_state(self, layer_idx):
        return []

    def on_attention(self, view):
        if view.phase.value == "score":
            self.clock.t += self.pass_cost
            view.state.append((view.pass_info, view.n_new, view.stored))
        return None

    def on_prompt_end(self, view):
        n = view.stored
        return span(n - self.budget, n, view.keys)


def test_scoring_passes_are_timed_apart_from_the_prefill(monkeypatch):
    """`measure_cell` runs a method's scoring passes through the helper `kvtrim.compress` uses, between
    the prompt and its end: the fake clock moves only inside the passes' hooks, so `scoring_s` is exactly
    their cost, the prefill none of it, and `compress_s` = eviction work + passes."""
    import kvtrim
    from kvtrim.bench.summary import derive
    from kvtrim.compress import compress

    model = tiny_model("llama", layers=2)
    kvtrim.enable(model)
    clock = FakeClock()
    monkeypatch.setattr("time.perf_counter", clock)
    method = ClockedPasses(clock=clock)

    class Spec:  # a spec that builds this very instance
        label = "clockedpasses"

        def build(self, n, ratio):
            return method

    spec = Spec()
    cfg = BenchConfig(methods=[], compression_ratio=0.5, new_tokens=2, collect_garbage=False, same_size_decode=False)
    ids = torch.randint(0, 200, (1, 40))
    row = measure_cell(model, spec, ids, cfg, 40)
    assert row["status"] == "ok" and row["scoring_passes"] == 3
    assert row["scoring_s"] == 3 * 2 * 2.0  # 3 passes x 2 layers x pass_cost
    assert row["scoring_evict_s"] == row["scoring_s"] and row["prefill_evict_s"] == 0.0 and row["prefill_s"] == 0.0
    assert row["stored_per_layer_prefill"] == [8, 8]
    derived = derive(row)
    assert derived["compress_s"] == 12.0 and derived["compress_vs_prefill"] is None  # no forward time on this clock
    # kvtrim.compress runs the same passes with the same timing
    clock.t = 0.0
    ctx = compress(model, ids, ClockedPasses(clock=clock))
    assert ctx.scoring_seconds == 12.0 and ctx.prefill_seconds == 0.0
    states = [layer.state for layer in ctx.cache.trim_layers()]
    # every pass saw the whole prompt stored plus its own 4 entries, and left nothing behind
    assert all(s == [(0, 4, 44), (1, 4, 44), (2, 4, 44)] for s in states)
    assert ctx.stats().stored_per_layer == [8, 8]


def test_compression_cost_in_the_summary():
    from kvtrim.bench.summary import compression_cost

    assert compression_cost(10.0, 1.0, 0.0) == (1.0, 1.0 / 9.0)
    assert compression_cost(10.0, 1.0, 17.0) == (18.0, 2.0)
    base = {"status": "ok", "length": 64, "repeat": 0, "prompt_tokens": 64, "decode_s": 1.0, "decode_tokens": 4,
            "decode_evict_s": 0.0, "prefill_evict_s": 0.0}
    rows = [dict(base, method="full", prefill_s=4.0),  # results written before scoring_s existed: 0
            dict(base, method="x", prefill_s=5.0, prefill_evict_s=1.0, scoring_s=7.0)]
    full, x = summarize(rows, 0.5)
    assert full["scoring_s"] == 0.0 and full["compress_s"] == 0.0
    assert x["scoring_s"] == 7.0 and x["compress_s"] == 8.0 and x["compress_vs_prefill"] == 2.0
    assert x["compress_vs_full_prefill"] == 2.0


def test_cli_with_a_named_model_and_threads(tmp_path, monkeypatch):
    """Regression: with a model that is not `arch:` (its config is read before the weights load),
    `kvtrim bench --threads 1` used to hand the model's config to the benchmark (AttributeError)."""
    import kvtrim.bench.arch as arch
    import kvtrim.models as models
    from conftest import tiny_config
    from kvtrim.cli import main

    monkeypatch.setattr(models, "load_tokenizer_and_config", lambda name: (None, tiny_config("llama")))
    monkeypatch.setattr(arch, "configured_context", lambda name: 4096)
    monkeypatch.setattr(arch, "load_bench_model", lambda name, *a, **k: (
        tiny_model("llama"), None, {"name": name, "weights": "pretrained"}))
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--threads", "1", "--model", "some-local-model", "--methods", "streaming", "--lengths", "48",
                   "--repeats", "1", "--max-new-tokens", "2", "--trace-length", "0", "--no-warmup", "--no-plots",
                   "--out", str(tmp_path / "b")])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    result = read_json(tmp_path / "b" / "bench.json")
    assert validate_result(result) == [] and [r["method"] for r in result["summary"]] == ["full", "streaming"]


@pytest.mark.integration
def test_kvzip_cell_on_smollm2_runs_its_passes(smollm):
    """KVzip through the benchmark on the real default model: its reconstruction passes run (and are
    timed apart), and the cache keeps what `kvtrim.compress` keeps for the same prompt."""
    from kvtrim.compress import compress

    model, tok = smollm
    cfg = BenchConfig(methods=[], compression_ratio=0.5, new_tokens=2, collect_garbage=False, same_size_decode=False)
    ids = tok("The quick brown fox jumps over the lazy dog. " * 30, return_tensors="pt").input_ids
    row, cache = measure_cell(model, parse_spec("kvzip"), ids, cfg, ids.shape[-1], return_cache=True, tokenizer=tok,
                              paths=True)
    assert row["status"] == "ok" and row["scoring_passes"] == 1 and row["scoring_s"] > 0
    # its path peak: through the scoring passes (stock generate cannot run them: not measured)
    assert row["path_peak_prefill_bytes"] > 0 and row["path_peak_generate_bytes"] is None
    ctx = compress(model, ids, parse_spec("kvzip").build(ids.shape[-1], 0.5), tokenizer=tok)
    n = ids.shape[-1]
    for mine, theirs in zip(cache.trim_layers(), ctx.cache.trim_layers()):  # head level: ragged rows (-1 pads)
        for a, b in zip(mine.kept_positions().flatten(0, 1), theirs.kept_positions().flatten(0, 1)):
            a, b = a[a >= 0], b[b >= 0]  # the bench cache also holds its decoded tokens, after the prompt's
            assert torch.equal(a[a < n], b) and (a >= n).sum() == cfg.new_tokens


def test_batch_sizes_measure_one_cache_of_distinct_prompts(tmp_path, capsys):
    """`--batch-sizes 1,2`: each cell also runs on a batch of two distinct, equal-length prompts in one
    cache: twice the stored bytes of a uniform method, the first sequence decoding as it does alone, the
    batch throughput derived from the rows; the main summary stays the batch-1 summary."""
    from kvtrim.bench.summary import summarize
    from kvtrim.cli import main

    out = tmp_path / "b"
    args = ["bench", "--threads", "1", "--model", "arch:tiny-llama", "--methods", "keydiff:block_size=16,streaming",
            "--lengths", "96", "--compression-ratio", "0.5", "--repeats", "1", "--max-new-tokens", "3",
            "--trace-length", "0", "--no-warmup", "--no-plots", "--quiet", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert main(args + ["--batch-sizes", "1,2"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = read_json(out / "bench.json")
    assert validate_result(result) == []
    cells = {(r["method"], r["batch"]): r for r in result["raw"]}
    assert sorted(cells) == sorted((m, b) for m in ("full", "keydiff:block_size=16", "streaming") for b in (1, 2))
    for method in ("full", "keydiff:block_size=16", "streaming"):
        one, two = cells[method, 1], cells[method, 2]
        assert two["stored_bytes_prefill"] == 2 * one["stored_bytes_prefill"] > 0
        # dense layers: exactly what is held, plus, after an in-place decode step (StreamingLLM at its
        # budget), the one free slot per row that the next step's entry takes
        per_row = round(two["stored_per_layer_prefill"][0])  # entries per row, at the budget here
        free = two["stored_bytes_end"] // per_row if method == "streaming" else 0
        assert two["allocated_bytes_end"] == two["stored_bytes_end"] + free
        assert two["first_tokens"] == one["first_tokens"]  # the first sequence decodes as it does alone
    assert [s["method"] for s in result["summary"]] == [s["method"] for s in summarize(
        [r for r in result["raw"] if r["batch"] == 1])]
    by = {(s["method"], s["batch"]): s for s in result["batch_summary"]}
    two = cells["streaming", 2]
    assert by["streaming", 2]["batch_decode_tps"] == pytest.approx(2 * two["decode_tokens"] / two["decode_s"])
    assert by["full", 2]["batch_decode_tps_vs_full"] == 1.0 and by["streaming", 1]["batch_decode_tps_vs_batch1"] == 1.0
    assert by["streaming", 2]["decode_step_vs_same_size"] == pytest.approx(two["decode_untimed_s"] / two["decode_same_size_full_s"])
    assert by["full", 2]["decode_step_vs_same_size"] is None  # the full cache is its own same-size cache
    for bad, message in (("0", "--batch-sizes must be integers >= 1"), ("1,1", "--batch-sizes has duplicates")):
        assert main(args + ["--batch-sizes", bad, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1
