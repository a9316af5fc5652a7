"""Scoring on hand-made predictions (RULER's string_match_all / part, passkey exact / partial)."""

from __future__ import annotations

import pytest

from kvtrim.eval.report import markdown_tables, summarize
from kvtrim.eval.scoring import passkey_scores, score_prediction, string_match_all, string_match_part


def test_string_match_all_is_the_fraction_of_references_found_case_insensitive():
    refs = ["Apple", "banana", "7654321", "zz-top"]
    assert string_match_all("I saw APPLE and Banana.", refs) == 0.5
    assert string_match_all("apple banana 7654321 ZZ-TOP", refs) == 1.0
    assert string_match_all("", refs) == 0.0
    assert string_match_all("765432", ["7654321"]) == 0.0  # a prefix is not a match
    assert string_match_all("  \x00 7654321\x07 ", ["7654321"]) == 1.0


def test_string_match_part_is_any_reference():
    assert string_match_part("the answer is Banana", ["apple", "banana"]) == 1.0
    assert string_match_part("the answer is cherry", ["apple", "banana"]) == 0.0


def test_passkey_exact_and_partial():
    key = "1234567890" * 6 + "1234"
    assert passkey_scores(f"The pass key is {key}.", key) == (1.0, 1.0)
    exact, partial = passkey_scores("The pass key is 12345678901234.", key)
    assert exact == 0.0 and partial == pytest.approx(14 / 64)
    assert passkey_scores("no digits here", key) == (0.0, 0.0)
    assert passkey_scores("99 then 1234", key)[1] == pytest.approx(4 / 64)  # best run counts
    assert passkey_scores("12345", "12345") == (1.0, 1.0)
    assert passkey_scores("12354", "12345") == (0.0, 3 / 5)


def test_score_prediction_picks_the_tasks_metric():
    s = score_prediction("string_match_all", "a b", ["a", "c"])
    assert s["score"] == 0.5 and s["string_match_part"] == 1.0
    p = score_prediction("passkey", "key 12399", ["12345"])
    assert p["score"] == p["passkey_exact"] == 0.0 and p["passkey_partial"] == 0.6


def _row(method, ratio, task, score, comp, **kw):
    return {"method": method, "compression_ratio": ratio, "length": 1000, "task": task, "score": score,
            "string_match_all": score, "string_match_part": score, "achieved_compression": comp,
            "final_compression": comp, "seconds": 1.0, **kw}


def test_summary_averages_samples_then_tasks():
    rows = [
        _row("full", 0.0, "a", 1.0, 0.0), _row("full", 0.0, "a", 0.0, 0.0), _row("full", 0.0, "b", 1.0, 0.0),
        _row("x", 0.5, "a", 1.0, 0.5), _row("x", 0.5, "b", 0.0, 0.52),
        {"method": "y", "compression_ratio": 0.5, "length": 1000, "task": "a", "skipped": "too tight"},
    ]
    summary = {(r["method"], r["task"]): r for r in summarize(rows)}
    assert summary[("full", "a")]["score"] == 50.0 and summary[("full", "a")]["n"] == 2
    assert summary[("full", "average")]["score"] == 75.0  # mean of task means, not of samples
    assert summary[("x", "average")]["achieved_compression"] == pytest.approx(0.51)
    assert "score" not in summary[("y", "average")] and summary[("y", "a")]["skipped"] == 1
    md = markdown_tables(summarize(rows))
    assert "| full | 0 | 0.000 | 50.0 [9, 91] (n=2) | 100.0 [21, 100] | **75.0** [—] (n=3) |" in md
    assert "| y | 0.5 | — | n/a |" in md
