"""Scoring, as RULER does it, plus the passkey metrics.

* `string_match_all`: fraction of the references contained in the prediction (case-insensitive);
  RULER's metric for niah / vt / cwe / fwe.
* `string_match_part`: 1 if any reference is contained in the prediction; RULER's metric for qa.
* `passkey`: exact = the key is contained in the prediction; partial = the longest common prefix of the
  key and a run of digits in the prediction, divided by the key length (1 when exact). Partial match is
  the headline needle metric of the LagKV paper's 64-digit test; the exact formula of its harness was
  not published in the paper, this is our definition.

Scores are in [0, 1] per sample; reports multiply averages by 100.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")
_DIGITS = re.compile(r"\d+")


def clean_prediction(text: str) -> str:
    """RULER's post-processing: control characters become newlines, outer whitespace goes."""
    return _CONTROL.sub("\n", text.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    pred = clean_prediction(prediction).lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    pred = clean_prediction(prediction).lower()
    return float(any(ref.lower() in pred for ref in references))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def passkey_scores(prediction: str, key: str) -> tuple[float, float]:
    """`(exact, partial)` for one passkey prediction."""
    if key in prediction:
        return 1.0, 1.0
    runs = _DIGITS.findall(prediction)
    partial = max((_common_prefix(run, key) for run in runs), default=0) / len(key)
    return 0.0, partial


def score_prediction(metric: str, prediction: str, references: list[str]) -> dict[str, float]:
    """All scores of one prediction; `score` is the task's own metric."""
    scores = {
        "string_match_all": string_match_all(prediction, references),
        "string_match_part": string_match_part(prediction, references),
    }
    if metric == "passkey":
        exact, partial = passkey_scores(prediction, references[0])
        scores.update(passkey_exact=exact, passkey_partial=partial, score=exact)
    else:
        scores["score"] = scores[metric]
    return scores
