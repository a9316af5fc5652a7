"""The sweep runner: prefill reuse equals recomputation, resume skips finished rows, reports get written."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_model

from kvtrim.attention import enable
from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.report import summarize, write_report
from kvtrim.eval.runner import RESULTS, Runner, RunSettings, plan
from kvtrim.specs import parse_method_specs
from kvtrim.eval.tasks import generate_samples
from kvtrim.methods import METHODS
from kvtrim.methods.base import KvtrimError
from kvtrim.compress import compress
from kvtrim.methods import FullCache, KeyDiff

# every registered method, with parameters that make it evict on ~400-token prompts
SPECS = {
    "full": "full", "lagkv": "lagkv:sink_size=4:lag_size=16", "streaming": "streaming",
    "keydiff": "keydiff:block_size=32", "snapkv": "snapkv:window=8", "h2o": "h2o", "tova": "tova",
    "lazyeviction": "lazyeviction:window=16", "adakv": "adakv:method=snapkv:window=8",
}


def _specs():
    names = [SPECS.get(name, name) for name in METHODS]
    try:
        return parse_method_specs(names)
    except KvtrimError:  # a method whose parameters changed: fall back to its defaults
        return parse_method_specs(list(METHODS))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama (GQA 4/2) whose vocabulary covers the SmolLM2 tokenizer, on kvtrim attention."""
    return enable(tiny_model("llama", vocab=49152, layers=2))


@pytest.fixture(scope="module")
def samples(tok):
    fmt = PromptFormat(tok)
    return generate_samples("niah_single_1", fmt, 400, 1, seed=1) + generate_samples(
        "passkey", fmt, 300, 1, seed=1, depths=(0.5,))


def _layers(cache: TrimCache):
    return [layer for layer in cache.layers if isinstance(layer, TrimLayer)]


def test_replayed_cache_equals_direct_prefill(model, tok, samples, ratio=0.75):
    """For every method that reuses the prefill: same stored keys, values, positions and the same next logits."""
    ids = PromptFormat(tok).encode(samples[0])[0]
    n = ids.shape[-1]
    shared = compress(model, ids, FullCache(), record_queries=True)
    checked = 0
    for spec in _specs():
        try:
            method = spec.build(n, ratio)
        except KvtrimError:
            continue
        if method.prefill_block_size() is not None or method.scoring_passes:
            continue
        direct = compress(model, ids, method)
        replayed = shared.recompress(spec.build(n, ratio))
        assert torch.equal(direct.logits, shared.logits)
        for a, b in zip(_layers(direct.cache), _layers(replayed.cache), strict=True):
            assert a.is_ragged == b.is_ragged and torch.equal(a.lengths, b.lengths), spec.label
            if a.is_ragged:  # AdaKV: compare the stored entries of every row
                va, vb = a.storage.padded(), b.storage.padded()
                assert torch.equal(va.positions, vb.positions), spec.label
                assert torch.equal(va.keys[va.valid], vb.keys[vb.valid]), spec.label
                assert torch.equal(va.values[va.valid], vb.values[vb.valid]), spec.label
            else:
                assert torch.equal(a.positions, b.positions), spec.label
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), spec.label
            assert a.seen == b.seen == n
        if not spec.is_full and method.name != "lazyeviction":  # lazyeviction keeps the prompt at prefill
            assert _layers(replayed.cache)[0].stored < n, f"{spec.label} evicted nothing: the test would prove little"
        # the next step (a question token) behaves the same on both caches
        step = torch.tensor([[42]])
        pos = torch.tensor([[n]])
        out_d = model(input_ids=step, cache=direct.cache, position_ids=pos).logits
        out_r = model(input_ids=step, cache=replayed.cache, position_ids=pos).logits
        assert torch.equal(out_d, out_r), spec.label
        checked += 1
    assert checked >= 3


def test_reuse_rule(model, tok, samples):
    ids = PromptFormat(tok).encode(samples[0])[0]
    shared = compress(model, ids, FullCache())
    with pytest.raises(KvtrimError, match="block by block"):  # block-wise prefill changes hidden states
        shared.recompress(KeyDiff(budget=64))
    assert shared.recompress(KeyDiff(compression_ratio=0.5)).stats().compression_ratio > 0.4  # one-shot: fine
    with pytest.raises(KvtrimError, match="queries"):  # no queries recorded
        shared.recompress(parse_method_specs("snapkv")[0].build(ids.shape[-1], 0.5))
    chunked = compress(model, ids, FullCache(), chunk_size=64)
    with pytest.raises(KvtrimError, match="one forward"):
        chunked.recompress(KeyDiff(compression_ratio=0.5))


def _run(model, tok, samples, out, reuse, specs=None, ratios=(0.8,)):
    settings = RunSettings(model="tiny", max_new_tokens=4, reuse_prefill=reuse, stop_when_answered=False)
    runner = Runner(model, tok, settings, str(out), progress=False)
    return runner, runner.run(plan(samples, specs or _specs(), list(ratios)))


def test_sweep_with_prefill_reuse_matches_recomputing(model, tok, samples, tmp_path):
    _, reused = _run(model, tok, samples, tmp_path / "reuse", reuse=True)
    _, fresh = _run(model, tok, samples, tmp_path / "fresh", reuse=False)
    assert [r["key"] for r in reused] == [r["key"] for r in fresh]
    assert not any(r.get("prefill_reused") for r in fresh)
    assert sum(bool(r.get("prefill_reused")) for r in reused) >= len(reused) // 2
    for a, b in zip(reused, fresh):
        assert a.get("skipped") == b.get("skipped")
        if "skipped" in a:
            continue
        assert a["prediction"] == b["prediction"], a["key"]
        assert a["achieved_compression"] == b["achieved_compression"], a["key"]
        assert a["final_compression"] == b["final_compression"], a["key"]
    for r in reused:
        if "skipped" not in r and r["method_name"] == "keydiff":
            assert not r["prefill_reused"]
    assert any(0.7 < r.get("achieved_compression", 0) for r in reused)


def test_resume_skips_finished_rows(model, tok, samples, tmp_path):
    specs = parse_method_specs(["full", "streaming"])
    runner, rows = _run(model, tok, samples, tmp_path, reuse=True, specs=specs, ratios=(0.5,))
    assert len(rows) == 4
    path = os.path.join(tmp_path, RESULTS)
    lines = open(path).read().splitlines()
    # an interrupted run: the last row was cut in the middle of writing
    open(path, "w").write("\n".join(lines[:2]) + "\n" + lines[2][:20] + "\n")
    calls = []
    original = Runner.run_job

    def spy(self, job, *args):
        calls.append(job.key)
        return original(self, job, *args)

    Runner.run_job = spy
    try:
        _, again = _run(model, tok, samples, tmp_path, reuse=True, specs=specs, ratios=(0.5,))
        assert calls == [json.loads(line)["key"] for line in lines[2:]]
        calls.clear()
        _run(model, tok, samples, tmp_path, reuse=True, specs=specs, ratios=(0.5,))
        assert calls == []  # nothing left to do
    finally:
        Runner.run_job = original
    assert sorted(r["key"] for r in again) == sorted(json.loads(line)["key"] for line in lines)
    with pytest.raises(KvtrimError, match="other settings"):
        Runner(model, tok, RunSettings(model="tiny", max_new_tokens=6), str(tmp_path), progress=False).run([])


def test_query_aware_compresses_the_question_too(model, tok, samples, tmp_path):
    settings = RunSettings(model="tiny", query_aware=True, max_new_tokens=3, stop_when_answered=False)
    runner = Runner(model, tok, settings, str(tmp_path), progress=False)
    rows = runner.run(plan(samples[:1], parse_method_specs(["full", "streaming"]), [0.5]))
    prefix, suffix = PromptFormat(tok).encode(samples[0])
    assert all(r["compressed_tokens"] == prefix.shape[-1] + suffix.shape[-1] for r in rows)


def test_unbuildable_method_is_recorded_as_skipped(model, tok, samples, tmp_path):
    rows = _run(model, tok, samples[:1], tmp_path, reuse=True, specs=parse_method_specs(["lagkv"]), ratios=(0.99,))[1]
    assert len(rows) == 1 and "skipped" in rows[0] and "score" not in rows[0]


def test_report_files(model, tok, tmp_path):
    fmt = PromptFormat(tok)
    samples = generate_samples("niah", fmt, 300, 1, depths=(0.0, 1.0))
    _, rows = _run(model, tok, samples, tmp_path, reuse=True, specs=parse_method_specs(["full", "streaming"]),
                   ratios=(0.5,))
    files = write_report(rows, str(tmp_path), header="# test run")
    md = open(files["markdown"]).read()
    assert "| full | 0 |" in md and "| streaming | 0.5 |" in md and "synthetic" in md
    assert os.path.exists(files["csv"]) and all(os.path.getsize(p) > 1000 for p in files["plots"])
    assert any("heatmap_niah_streaming" in p for p in files["plots"])
    avg = [r for r in summarize(rows) if r["task"] == "average" and r["method"] == "streaming"][0]
    assert 0.45 < avg["achieved_compression"] < 0.55


def test_waits_for_attention_flags():
    assert not METHODS["lagkv"]().waits_for_attention
    assert METHODS["snapkv"].at_budget(64, 400).waits_for_attention


@pytest.mark.integration
def test_real_model_retrieves_and_reuse_matches_recompute(smollm, tmp_path):
    """SmolLM2: the full cache finds a mid-context needle, StreamingLLM at 0.875 cannot (the needle is
    evicted), and replaying the shared prefill gives the very same answers as prefilling each method
    (SnapKV: the queries recorded in the shared prefill are the ones its direct prefill hands over)."""
    model, tok = smollm
    enable(model)
    samples = generate_samples("niah", PromptFormat(tok), 1024, 1, seed=0, depths=(0.5,))
    results = {}
    for reuse, names in ((True, ["full", "streaming", "snapkv"]), (False, ["streaming", "snapkv"])):
        settings = RunSettings(model="smollm2-135m", max_new_tokens=12, reuse_prefill=reuse)
        rows = Runner(model, tok, settings, str(tmp_path / str(reuse)), progress=False).run(
            plan(samples, parse_method_specs(names), [0.875]))
        results[reuse] = {r["method"]: r for r in rows}
    full, streaming = results[True]["full"], results[True]["streaming"]
    assert full["score"] == 1.0, full["prediction"]
    assert streaming["score"] == 0.0 and streaming["achieved_compression"] > 0.85, streaming["prediction"]
    assert all(r["prefill_reused"] for r in results[True].values())
    assert not any(r["prefill_reused"] for r in results[False].values())
    for method, row in results[False].items():
        assert row["prediction"] == results[True][method]["prediction"], method


def _expected_trace(start: int, steps: int, budget: int, every: int, slack: int = 1) -> list[int]:
    """Entries stored before decoding and after each decode forward, simulated one step at a time: each
    forward appends its token; a method evicting every `every` steps (LazyEviction's window; 1 for
    step-wise methods) cuts back to `budget` when the layer holds at least `budget + slack`."""
    trace, stored = [start], start
    for t in range(1, steps + 1):
        stored += 1
        if t % every == 0 and stored >= budget + slack:
            stored = budget
        trace.append(stored)
    return trace


def test_budget_sweep_records_the_cache_while_decoding(model, tok, samples, tmp_path):
    """`--budgets`: rows keyed by budget (ratio null), each method at that absolute size; the stored trace
    follows each method's schedule (full grows by one per token, StreamingLLM stays at the budget,
    LazyEviction grows to budget + window and falls back every window steps); peak and final from it."""
    settings = RunSettings(model="tiny", max_new_tokens=40, stop_when_answered=False)
    runner = Runner(model, tok, settings, str(tmp_path), progress=False)
    specs = parse_method_specs(["full", "streaming", "lazyeviction:window=16", "h2o"])
    rows = {r["method"]: r for r in runner.run(plan(samples[:1], specs, [], [64]))}
    assert [r["key"].split("|")[-1] for r in rows.values()] == ["0", "b64", "b64", "b64"]
    prefix, suffix = PromptFormat(tok).encode(samples[0])
    n, m = prefix.shape[-1], suffix.shape[-1]
    for r in rows.values():
        assert r["new_tokens"] == 40 and len(r["stored_trace"]) == 40  # the last token is never fed back
        assert r["final_stored"] == r["stored_trace"][-1] and r["peak_stored"] == max(r["stored_trace"][:-1]) + 1
    full, stream, lazy, h2o = (rows[k] for k in ("full", "streaming", "lazyeviction:window=16", "h2o"))
    assert full["compression_ratio"] == 0 and stream["compression_ratio"] is None and stream["budget"] == 64
    assert full["stored_trace"] == list(range(n + m, n + m + 40)) and full["final_compression"] == 0
    # StreamingLLM and H2O: the prompt cut to the budget (the question appended, then cut), every step after
    assert stream["stored_trace"] == [64] * 40 and stream["peak_stored"] == 65
    assert h2o["stored_trace"] == [64] * 40
    # LazyEviction keeps the prompt, then evicts at steps 16 and 32
    assert lazy["stored_trace"] == _expected_trace(n + m, 39, 64, 16)
    assert lazy["stored_trace"][16] == 64 and max(lazy["stored_trace"][17:]) <= 64 + 16
    # the compression at the end of the generation: entries removed of every token seen (all layers alike)
    assert lazy["final_compression"] == pytest.approx(1 - lazy["final_stored"] / (n + m + 39))
    assert lazy["achieved_compression"] == 0  # nothing evicted at prefill

    files = write_report(list(rows.values()), str(tmp_path), header="# budgets")
    md = open(files["markdown"]).read()
    assert "| streaming | budget 64 |" in md and "peak stored" in md
    names = sorted(os.path.basename(p) for p in files["plots"])
    assert names == ["score_vs_budget.png", "stored_entries.png"]
    avg = [r for r in summarize(list(rows.values())) if r["task"] == "average" and r["budget"] == 64]
    assert {r["method"] for r in avg} == {"streaming", "lazyeviction:window=16", "h2o"}


def test_budget_and_ratio_rows_are_different_cells(model, tok, samples, tmp_path):
    specs = parse_method_specs(["streaming"])
    rows = _run(model, tok, samples[:1], tmp_path, reuse=True, specs=specs, ratios=(0.5,))[1]
    more = Runner(model, tok, RunSettings(model="tiny", max_new_tokens=4, stop_when_answered=False), str(tmp_path),
                  progress=False).run(plan(samples[:1], specs, [0.5], [100]))
    assert len(rows) == 1 and len(more) == 2  # the ratio row is not redone, the budget row is new
    by_key = {r["key"].split("|")[-1]: r for r in more}
    assert by_key["0.5"]["budget"] == by_key["0.5"]["compressed_tokens"] // 2 and by_key["b100"]["budget"] == 100


REASONING_FILE = os.path.join(os.path.dirname(__file__), "data", "reasoning_tasks.jsonl")


def test_budget_sweep_on_the_hand_written_reasoning_file(model, tok, tmp_path):
    """A GSM8K / MATH-style task file through a budget sweep, end to end: each row decodes to its own
    `max_new_tokens` (512-2048 in the file; capped here to keep the test short), is scored by its row's
    metric (`final_number`, `boxed`, `trace`), and the budget methods evict while the answer grows:
    H2O at the budget every step, LazyEviction back to the budget every `window` steps."""
    from kvtrim.eval.sample import read_task_file
    from kvtrim.eval.scoring import score_prediction

    samples = {s.id: s for s in read_task_file(REASONING_FILE)}
    assert min(s.max_new_tokens for s in samples.values()) >= 512
    cap, budget, window = 120, 24, 16
    settings = RunSettings(model="tiny", max_new_tokens=cap, stop_when_answered=False)
    specs = parse_method_specs(["full", f"lazyeviction:window={window}", "h2o"])
    rows = Runner(model, tok, settings, str(tmp_path), progress=False).run(plan(list(samples.values()), specs, [],
                                                                               [budget]))
    assert len(rows) == 3 * len(samples)
    seen = set()
    for r in rows:
        sample = samples[r["sample_id"]]
        seen.add(r["metric"])
        assert r["metric"] == sample.metric and r["max_new_tokens"] == cap
        expect = score_prediction(sample.metric, r["prediction"], sample.answers)
        assert {k: r[k] for k in expect} == expect
        assert ("trace_partial" in r) == (sample.metric == "trace") and "boxed" in r
        trace, start = r["stored_trace"], r["stored_trace"][0]
        assert len(trace) == r["new_tokens"] > 2 * (budget + window)  # random weights: no early EOS
        if r["method"] == "full":
            assert trace == list(range(start, start + len(trace)))
        elif r["method"] == "h2o":
            assert trace == [budget] * len(trace)
        else:  # LazyEviction keeps the prompt, then cuts to the budget at every multiple of the window
            assert trace == _expected_trace(start, len(trace) - 1, budget, window)
            assert trace[window] == budget and max(trace[window:]) <= budget + window
            assert r["final_compression"] > 0
    assert seen == {"final_number", "boxed", "trace"}


def test_report_names_the_synthetic_rows_beside_essay_rows(tmp_path):
    """Essay rows and generated ones in one run: the synthetic-haystack note names the tasks it is about."""
    def row(task, haystack):
        r = {"key": f"{task}|full|0", "sample_id": f"{task}/0", "task": task, "length": 2048, "method": "full",
             "compression_ratio": 0.0, "budget": None, "metric": "string_match_all", "score": 1.0,
             "string_match_all": 1.0, "string_match_part": 1.0, "final_compression": 0.0, "peak_stored": 10,
             "final_stored": 10, "prompt_tokens": 10, "compressed_tokens": 10, "seconds": 1.0, "depth": 0.5,
             "kv_bytes": 100, "kv_bytes_full": 100, "stored_per_layer_mean": 10.0,
             "achieved_compression": 0.0, "new_tokens": 4}
        return dict(r, haystack=haystack) if haystack else r

    md = open(write_report([row("niah_single_2", "essay"), row("vt", None), row("niah_single_1", None)],
                           str(tmp_path), plots=False)["markdown"]).read()
    assert "Rows of niah_single_1, vt: the haystacks are synthetic" in md and "Paul Graham's essays (the wheel" in md
    md = open(write_report([row("vt", None)], str(tmp_path), plots=False)["markdown"]).read()
    assert "The haystacks are synthetic" in md and "Rows of" not in md and "--haystack essay" not in md
