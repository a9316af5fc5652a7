"""The run count and wall-time estimate `kvtrim eval` prints before it starts (`kvtrim.eval.estimate`)."""

from __future__ import annotations

import json
import os

import pytest

from kvtrim.eval.estimate import LIKELY_SHARE, REFERENCE, answer_steps, approx_params, decode_share, estimate, probe_rates
from kvtrim.eval.runner import plan
from kvtrim.eval.sample import Sample
from kvtrim.specs import parse_method_specs

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_reference_rates_are_the_committed_measurement():
    with open(os.path.join(ROOT, "benchmarks", "eval_estimate", "rates.json"), encoding="utf-8") as f:
        measured = json.load(f)
    for key, value in REFERENCE.items():
        assert value == pytest.approx(measured[key], rel=0.01), key


def test_approx_params_of_smollm2_is_close_to_its_count():
    from transformers import AutoConfig

    from kvtrim.models import resolve_model_dir

    config = AutoConfig.from_pretrained(resolve_model_dir("smollm2-135m"))
    assert approx_params(config) == pytest.approx(REFERENCE["params"], rel=0.01)


def test_estimate_counts_what_the_runner_runs():
    samples = [Sample(id=f"s{i}", task="t", context=f"c{i}", question="q", answers=["a"], max_new_tokens=10) for i in range(2)]
    jobs = plan(samples, parse_method_specs(["full", "streaming", "snapkv", "kvzip"]), [0.5, 0.75])
    assert len(jobs) == 2 * (1 + 3 * 2)
    encoded = {"s0": (1000, 20), "s1": (500, 20)}
    rates = {"params": 100, "prefill_s_per_token": 0.001, "decode_step_s": 0.1, "kvzip_s_per_token": 0.01}
    est = estimate(jobs, encoded, lambda job, n: job.spec.build(n, job.compression_ratio),
                   lambda m: not m.scoring_passes, lambda ms: True, lambda s: 3, lambda s: 10, params=200,
                   rates=rates)
    # per sample: one shared prefill; KVzip's two runs at its own rate; every run feeds the question
    assert est.runs == 14 and est.samples == 2
    assert est.prefill_tokens == 1000 + 2 * 1000 + 500 + 2 * 500
    assert est.decode_min == 14 * 3 and est.decode_max == 14 * 10
    base = (1500 + 14 * 20) * 0.001 + 2 * 1500 * 0.01
    assert est.seconds_min == pytest.approx(2 * (base + 42 * 0.1))
    assert est.seconds_max == pytest.approx(2 * (base + 140 * 0.1))
    assert est.seconds_likely == pytest.approx(est.seconds_min + LIKELY_SHARE * (est.seconds_max - est.seconds_min))
    assert "ESTIMATED" in est.line() and "14 runs" in est.line() and "scaled by model size x2.00" in est.line()
    # two samples of one context: compressed once per cell, each question fed and answered
    for sample in samples:
        sample.context = "same"
    one = estimate(jobs, {"s0": (1000, 20), "s1": (1000, 30)}, lambda job, n: job.spec.build(n, job.compression_ratio),
                   lambda m: not m.scoring_passes, lambda ms: True, lambda s: 3, lambda s: 10, params=100, rates=rates)
    assert one.prefill_tokens == 1000 + 2 * 1000 and one.decode_max == 140
    # KVzip's scores shared across its two ratios: scored once per context
    from kvtrim.eval.kvzip_reuse import scoring_key

    est2 = estimate(jobs, {"s0": (1000, 20), "s1": (1000, 30)}, lambda job, n: job.spec.build(n, job.compression_ratio),
                    lambda m: not m.scoring_passes, lambda ms: True, lambda s: 3, lambda s: 10, params=100,
                    rates=rates, scoring_key=scoring_key)
    assert est2.prefill_tokens == 1000 + 1000
    assert one.seconds_max == pytest.approx((1000 + 7 * 20 + 7 * 30) * 0.001 + 2000 * 0.01 + 140 * 0.1)


def test_answer_steps_follow_the_metric():
    assert answer_steps("string_match_all", [4, 5, 3]) == 4 + 5 + 3 + 2 + 1  # every value, separators, one more
    assert answer_steps("string_match_part", [4, 5, 3]) == 4
    assert answer_steps("qa_f1_score", [4, 5, 3]) == 6
    assert answer_steps("string_match_all", [7]) == 8


def test_decode_share_of_finished_rows():
    rows = [{"task": "a", "new_tokens": 5, "max_new_tokens": 10}, {"task": "a", "new_tokens": 10, "max_new_tokens": 10},
            {"task": "b", "new_tokens": 2, "max_new_tokens": 10},  # stopped before its estimated minimum: counts as it
            {"task": "b", "new_tokens": 9}]  # an old row without its cap: left out
    assert decode_share(rows, lambda row: 5) == pytest.approx({"a": 5 / 10, "b": 0.0, None: 5 / 15})
    assert decode_share([], lambda row: 5) == {}
    assert decode_share(rows, lambda row: 10) == {}  # no range


def test_likely_time_takes_each_tasks_share():
    samples = [Sample(id=f"s{i}", task=t, context=f"c{i}", question="q", answers=["a"], max_new_tokens=10)
               for i, t in enumerate(["a", "b", "c"])]
    jobs = plan(samples, parse_method_specs(["full"]), [])
    rates = {"params": 1, "prefill_s_per_token": 0.0, "decode_step_s": 1.0, "kvzip_s_per_token": 0.0}
    args = ({s.id: (100, 0) for s in samples}, lambda job, n: job.spec.build(n, job.compression_ratio),
            lambda m: True, lambda ms: False, lambda s: 2, lambda s: 10)
    est = estimate(jobs, *args, params=1, rates=rates, shares_used={"a": 1.0, None: 0.5})
    assert (est.seconds_min, est.seconds_max) == (6, 30)
    assert est.seconds_likely == pytest.approx(10 + 6 + 6)  # a: its own share; b, c: the share over all rows
    est = estimate(jobs, *args, params=1, rates=rates)
    assert est.seconds_likely == pytest.approx(3 * (2 + LIKELY_SHARE * 8))


def test_probe_rates_measure_the_model():
    from conftest import tiny_model

    rates = probe_rates(tiny_model("llama", layers=2), 64, steps=2)
    assert rates["probed"] and rates["params"] == 1
    assert 0 < rates["prefill_s_per_token"] < rates["decode_step_s"]  # a step costs more than a prefilled token
    assert rates["kvzip_s_per_token"] == pytest.approx(
        rates["prefill_s_per_token"] * REFERENCE["kvzip_s_per_token"] / REFERENCE["prefill_s_per_token"])


@pytest.fixture
def fake_weights(monkeypatch):
    from conftest import tiny_model
    from transformers import AutoTokenizer

    import kvtrim.models
    from kvtrim.attention import enable

    model = enable(tiny_model("llama", vocab=49152, layers=2))
    tok = AutoTokenizer.from_pretrained(kvtrim.models.resolve_model_dir("smollm2-135m"))
    monkeypatch.setattr(kvtrim.models, "load_model", lambda *a, **k: (model, tok))


def test_eval_prints_the_estimate_first_and_the_table_last(fake_weights, tmp_path, capsys):
    from kvtrim.cli import main

    args = ["eval", "--tasks", "niah_single_1", "--lengths", "300", "--samples", "2", "--methods", "full,streaming",
            "--compression-ratios", "0.5", "--max-new-tokens", "3", "--no-plots", "--out", str(tmp_path / "o")]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("4 runs pending (2 samples)") and "ESTIMATED wall time" in out[0]
    assert "rates probed on the loaded model" in out[0]
    table = [line for line in out if line.startswith("| streaming | 0.5 |")]
    assert len(table) == 1 and "[" in table[0] and out[-1].startswith("score [95 % interval]")
    assert main(args) == 0  # resumed: nothing left to run
    assert capsys.readouterr().out.startswith("all 4 runs are already in")
