"""`kvtrim eval`: one-line errors for bad input (raised before the model loads), presets, task files."""

from __future__ import annotations

import json

import pytest

from kvtrim.cli import main


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtrim: error: ") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "niah_single_1,nope"], "unknown task nope"),
        (["--methods", "lagkv,nope"], "unknown method 'nope'"),
        (["--methods", "lagkv:nope=3"], "has no parameter 'nope'"),
        (["--methods", "lagkv:lag_size=big"], "cannot read 'big' as int"),
        (["--compression-ratios", "0.5,1.0"], "must be in [0, 1)"),
        (["--compression-ratios", "-0.1"], "must be in [0, 1)"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--budgets", "128,0"], "--budgets must be >= 1 entry"),
        (["--budgets", "128,128"], "--budgets has duplicates"),
        (["--budgets", "12x"], "expected comma-separated integers"),
        (["--depths", "1.5", "--tasks", "niah"], "--depths must be in [0, 1]"),
        (["--lengths", "100000"], "beyond the model's context of 8192"),
        (["--task-file", "/nonexistent/file.jsonl"], "cannot read task file"),
        (["--tasks", "vt", "--lengths", "200"], "vt at length 200"),
    ],
)
def test_bad_input_is_a_one_line_error(capsys, tmp_path, argv, message):
    assert message in _error(capsys, ["eval", "--out", str(tmp_path), *argv])


def test_bad_task_file_row(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"context": "c", "question": "q"}) + "\n")
    assert "answers" in _error(capsys, ["eval", "--task-file", str(path), "--out", str(tmp_path)])


def test_write_tasks_then_read_them_back(capsys, tmp_path):
    path = tmp_path / "tasks.jsonl"
    assert main(["eval", "--tasks", "niah_single_1,passkey", "--lengths", "512", "--samples", "1", "--depths", "0.5",
                 "--write-tasks", str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["task"] for r in rows] == ["niah_single_1", "passkey"]
    assert all(r["answers"][0] in r["context"] for r in rows)


def test_write_reasoning_tasks(capsys, tmp_path):
    path = tmp_path / "tasks.jsonl"
    assert main(["eval", "--tasks", "arith_recall,program_trace", "--lengths", "600", "--samples", "2",
                 "--write-tasks", str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["task"] for r in rows] == ["arith_recall"] * 2 + ["program_trace"] * 2
    assert all(r["metric"] == "trace" and len(r["answers"]) == r["meta"]["steps"] + 1 for r in rows)
    assert all(r["meta"]["prompt_tokens"] + r["max_new_tokens"] == 600 for r in rows)


def test_report_only_needs_results(capsys, tmp_path):
    assert "no results" in _error(capsys, ["eval", "--report-only", "--out", str(tmp_path)])


def test_presets_resolve():
    from kvtrim.eval.cli import _resolve, add_parser
    from kvtrim.eval.presets import PRESETS
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for name in PRESETS:
        args = parser.parse_args(["eval", "--preset", name, "--compression-ratios", "0.3"])
        cfg = _resolve(args)
        assert cfg["ratios"] == [0.3]  # explicit flags win
        assert cfg["tasks"] and cfg["lengths"] and cfg["methods"]
    quick = _resolve(parser.parse_args(["eval", "--preset", "quick"]))
    assert quick["model"] == "smollm2-135m" and any(m.startswith("lagkv") for m in quick["methods"])


def test_budgets_alone_replace_the_default_ratios():
    from kvtrim.eval.cli import _resolve, add_parser
    import argparse

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    alone = _resolve(parser.parse_args(["eval", "--budgets", "128,1k"]))
    assert alone["budgets"] == [128, 1024] and alone["ratios"] == []
    both = _resolve(parser.parse_args(["eval", "--budgets", "256", "--compression-ratios", "0.5"]))
    assert both["budgets"] == [256] and both["ratios"] == [0.5]
    assert _resolve(parser.parse_args(["eval"]))["budgets"] == []
    reasoning = _resolve(parser.parse_args(["eval", "--preset", "reasoning"]))
    assert reasoning["ratios"] == [] and len(reasoning["budgets"]) == 2 and reasoning["tasks"] == ["list_recall"]
    assert reasoning["methods"][0] == "full" and sum(m.startswith("lazyeviction") for m in reasoning["methods"]) == 2
    assert _resolve(parser.parse_args(["eval", "--preset", "reasoning-gpu"]))["budgets"] == [128, 256, 512, 1024]


def test_lengths_accept_k_suffix():
    from kvtrim.cli_args import lengths

    assert lengths("1024,4k,16K") == [1024, 4096, 16384]
