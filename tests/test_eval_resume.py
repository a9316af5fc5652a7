"""An interrupted `kvtrim eval` resumes without losing or merging a row, and records the interruption.

The sweep runs through the real command (`kvtrim.cli.main`) on a tiny random model (the weight load is
replaced; the tokenizer is SmolLM2's, so that the prompts are the real ones)."""

from __future__ import annotations

import json
import os

import pytest
from conftest import tiny_model

import kvtrim.models
from kvtrim.attention import enable
from kvtrim.cli import main
from kvtrim.eval.jsonl import read_jsonl
from kvtrim.eval.runner import RESULTS, Runner
from kvtrim.methods.base import KvtrimError

ARGS = ["eval", "--tasks", "niah_single_1,passkey", "--lengths", "300", "--samples", "1", "--depths", "0.5",
        "--methods", "full,streaming", "--compression-ratios", "0.5,0.75", "--max-new-tokens", "4", "--full-answers",
        "--no-plots", "--quiet"]
TIMING = ("seconds", "prefill_reused", "kvzip_scores_shared", "context_group")  # how a row was computed, not what it holds


@pytest.fixture(scope="module")
def model():
    return enable(tiny_model("llama", vocab=49152, layers=2))


@pytest.fixture
def fake_weights(monkeypatch, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(kvtrim.models.resolve_model_dir("smollm2-135m"))
    monkeypatch.setattr(kvtrim.models, "load_model", lambda *a, **k: (model, tok))


def _lines(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().split("\n")


def _content(rows: list[dict]) -> dict[str, dict]:
    return {r["key"]: {k: v for k, v in r.items() if k not in TIMING} for r in rows}


def test_interrupted_run_resumes_to_the_uninterrupted_result(fake_weights, tmp_path, capsys):
    whole, broken = str(tmp_path / "whole"), str(tmp_path / "broken")
    assert main([*ARGS, "--out", whole]) == 0
    reference = read_jsonl(os.path.join(whole, RESULTS))
    assert len(reference) == 2 * (1 + 2)  # 2 samples x (full + streaming at 2 ratios)

    # 1. a real interruption (Ctrl-C / SIGTERM) during the fourth row
    calls = []
    original = Runner.run_job

    def interrupt_at_four(self, job, *args):
        calls.append(job.key)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return original(self, job, *args)

    Runner.run_job = interrupt_at_four
    try:
        assert main([*ARGS, "--out", broken]) == 130
    finally:
        Runner.run_job = original
    results, invocations = os.path.join(broken, RESULTS), os.path.join(broken, "invocations.jsonl")
    first = read_jsonl(invocations)
    assert len(first) == 1 and first[0]["interrupted"] is True and first[0]["rows_run"] == 3
    assert len(read_jsonl(results)) == 3

    # 2. what a kill in the middle of a write leaves: the next row cut short (no newline), and a cut
    # invocation record
    cut_row = json.dumps(next(r for r in reference if r["key"] == calls[3]), ensure_ascii=False)
    with open(results, "a", encoding="utf-8") as f:
        f.write(cut_row[: len(cut_row) // 2])
    with open(invocations, "a", encoding="utf-8") as f:
        f.write('{"command": "kvtrim eval --tasks nia')
    capsys.readouterr()

    # 3. resume
    assert main([*ARGS, "--out", broken]) == 0
    err = capsys.readouterr().err
    assert "dropped a cut last line" in err and "results.jsonl" in err and "invocations.jsonl" in err

    lines = _lines(results)
    assert lines[-1] == "" and all(json.loads(line) for line in lines[:-1])  # every line parses
    rows = [json.loads(line) for line in lines[:-1]]
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)) == len(reference)  # every row exactly once
    assert _content(rows) == _content(reference)  # the same rows an uninterrupted run wrote
    runs = read_jsonl(invocations)
    assert [r["interrupted"] for r in runs] == [True, False]
    assert [r["rows_run"] for r in runs] == [3, 3]
    assert all(json.loads(line) for line in _lines(invocations)[:-1])
    assert "(interrupted)" in open(os.path.join(broken, "summary.md"), encoding="utf-8").read()


def test_complete_last_row_without_newline_is_kept(fake_weights, tmp_path, capsys):
    out = str(tmp_path)
    assert main([*ARGS, "--out", out]) == 0
    path = os.path.join(out, RESULTS)
    text = open(path, encoding="utf-8").read()
    open(path, "w", encoding="utf-8").write(text.rstrip("\n"))  # the newline of the last row was not written
    calls = []
    original = Runner.run_job
    Runner.run_job = lambda self, job, *a: calls.append(job.key) or original(self, job, *a)
    try:
        assert main([*ARGS, "--out", out]) == 0
    finally:
        Runner.run_job = original
    assert calls == []  # nothing redone, nothing lost
    assert open(path, encoding="utf-8").read() == text


def test_damage_that_is_not_a_cut_last_line_is_an_error(fake_weights, tmp_path, capsys):
    out = str(tmp_path)
    assert main([*ARGS, "--out", out]) == 0
    path = os.path.join(out, RESULTS)
    lines = _lines(path)
    # what the old resume did: a cut row with the next row appended to it, in the middle of the file
    lines[1] = lines[1][:40] + lines[2]
    open(path, "w", encoding="utf-8").write("\n".join(lines))
    capsys.readouterr()
    assert main([*ARGS, "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtrim: error: ") and "\n" not in err and f"{RESULTS}:2: not a valid JSON line" in err
    with pytest.raises(KvtrimError, match="expected a JSON object"):
        open(path, "w", encoding="utf-8").write("[1, 2]\n{}\n")
        read_jsonl(path)
