"""Scoring, as RULER does it, plus the passkey metrics.

* `string_match_all`: fraction of the references contained in the prediction (case-insensitive);
  RULER's metric for niah / vt / cwe / fwe.
* `string_match_part`: 1 if any reference is contained in the prediction; RULER's metric for qa.
* `passkey`: exact = the key is contained in the prediction; partial = the longest common prefix of the
  key and a run of digits in the prediction, divided by the key length (1 when exact). Partial match is
  the headline needle metric of the LagKV paper's 64-digit test; the exact formula of its harness was
  not published in the paper, this is our definition.
* `boxed` (MATH-style): exact = the content of the prediction's last `\\boxed{...}` equals a reference
  after normalisation (`normalize_answer`); no box, no credit.
* `final_number` (GSM8K-style): exact = the last `\\boxed{...}` if there is one, else the last number
  in the prediction, equals a reference (numbers compare by value: `1,000` = `1000.0`).
* `trace` (the generated reasoning tasks, `kvtrim.eval.reasoning`): `answers[0]` is the final answer,
  `answers[1:]` the value after each step. exact (`score`) = the `boxed` rule on `answers[0]`;
  `trace_partial` = the fraction of steps N whose first line `Step N: ... = V` ends with the right value
  (a step the prediction never reaches counts as wrong); `final_number` is reported too.

* LongBench's English metrics (THUDM/LongBench `metrics.py`, the definitions read there and written
  anew): `qa_f1` (token F1 after SQuAD-style normalisation), `rouge_l` (LCS F1 over words),
  `classification` (TREC: the named classes, 1/k when the right one is among the k), `retrieval` and
  `count` (the share of the numbers written that are right), `code_sim` (difflib similarity of the first
  code line); the best score over the references (`longbench_score`). These scores can fall when text is
  appended, so such rows are always decoded to EOS or the token cap (never stopped when answered).

Answer extraction is deliberately simple: no symbolic equivalence (`\\frac12` and `0.5` differ), as in
exact-match harnesses for MATH; see `normalize_answer` for what is normalised.

Scores are in [0, 1] per sample; reports multiply averages by 100.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter

_CONTROL = re.compile(r"[\x00-\x1f]")
_DIGITS = re.compile(r"\d+")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_STEP_LINE = re.compile(r"^[\s*#>-]*Step\s+(\d+)\s*:(.*)$", re.IGNORECASE | re.MULTILINE)

#: LongBench's English metrics (THUDM/LongBench `metrics.py`, written anew here; see `longbench_score`)
LONGBENCH_METRICS = ("qa_f1", "rouge_l", "classification", "retrieval", "count", "code_sim")
METRICS = ("string_match_all", "string_match_part", "passkey", "boxed", "final_number", "trace") + LONGBENCH_METRICS


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


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in `text` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth = 0
        for i in range(start + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start + len("\\boxed{"): i]
        start = text.rfind("\\boxed{", 0, start)  # unclosed (cut off): an earlier complete one counts
    return None


def last_number(text: str) -> str | None:
    """The last number written in `text` (`-3`, `1,234`, `2.5`), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def _as_number(text: str) -> float | None:
    t = text.replace(",", "").replace(" ", "")
    try:
        return float(t)
    except ValueError:
        return None


def normalize_answer(text: str) -> str:
    """Canonical form of an extracted answer: outer whitespace, `$`, a trailing `.`, `\\text{...}` wrappers,
    `\\left`/`\\right`, `\\dfrac`/`\\tfrac` (as `\\frac`) and inner spaces go; a number becomes its value
    (`1,000.0` -> `1000`)."""
    t = text.strip().strip("$").strip()
    t = re.sub(r"\\text\{([^{}]*)\}", r"\1", t)
    t = t.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    t = t.replace("\\!", "").replace("\\,", "").replace(" ", "").rstrip(".")
    value = _as_number(t)
    if value is not None and re.fullmatch(r"-?[\d,]*\.?\d*", t):
        return str(int(value)) if value == int(value) else repr(value)
    return t


def answer_matches(answer: str | None, references: list[str]) -> float:
    """1.0 if the extracted `answer` equals a reference after `normalize_answer`, else 0.0."""
    if answer is None:
        return 0.0
    got = normalize_answer(answer)
    return float(any(got == normalize_answer(ref) for ref in references))


def step_values(prediction: str) -> dict[int, str]:
    """`{N: V}` from the prediction's `Step N: ... = V` lines: V is the last number of the line; the first
    line of each N counts (a model that restarts its trace is judged by its first attempt)."""
    steps: dict[int, str] = {}
    for match in _STEP_LINE.finditer(prediction):
        number = last_number(match.group(2).split("\\boxed")[0])
        if number is not None:
            steps.setdefault(int(match.group(1)), number)
    return steps


def trace_partial(prediction: str, step_refs: list[str]) -> float:
    """Fraction of the reference steps (1-based, in order) whose value the prediction wrote right."""
    if not step_refs:
        return 0.0
    got = step_values(prediction)
    return sum(answer_matches(got.get(k), [ref]) for k, ref in enumerate(step_refs, start=1)) / len(step_refs)


# ---- LongBench's metrics ---------------------------------------------------------------------------
_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_text(text: str) -> str:
    """LongBench's (SQuAD's) answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: list[str], reference: list[str]) -> float:
    """F1 of the tokens two lists share (counted with multiplicity)."""
    common = sum((Counter(prediction) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    """LongBench's qa_f1_score: token F1 of the normalised prediction and reference."""
    return token_f1(normalize_text(prediction).split(), normalize_text(reference).split())


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (dynamic programming, one row at a time)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        row = [0]
        for j, y in enumerate(b, start=1):
            row.append(previous[j - 1] + 1 if x == y else max(previous[j], row[j - 1]))
        previous = row
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (beta = 1): the longest common subsequence of the lower-cased words (runs of letters and
    digits), over the prediction's and the reference's lengths. LongBench calls the `rouge` package,
    whose own tokenisation and handling of sentences can give slightly different values."""
    p, r = _WORD.findall(prediction.lower()), _WORD.findall(reference.lower())
    if not p or not r:
        return 0.0
    lcs = _lcs_length(p, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


_WORD = re.compile(r"[a-z0-9]+")


def classification(prediction: str, reference: str, all_classes: list[str]) -> float:
    """LongBench's classification_score: the classes named in the prediction, less those that are only part
    of the reference's name; 1 / (their number) when the reference is among them, else 0. (The official
    loop removes from the list it iterates, which can skip a class; here every such class is removed.)"""
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not (c in reference and c != reference)]
    return 1.0 / len(named) if reference in named else 0.0


def retrieval(prediction: str, reference: str) -> float:
    """LongBench's retrieval_score: the share of the numbers in the prediction that equal the reference's
    paragraph number (`Paragraph N`)."""
    found = re.findall(r"Paragraph (\d+)", reference)
    numbers = _DIGITS.findall(prediction)
    if not found or not numbers:
        return 0.0
    return sum(n == found[0] for n in numbers) / len(numbers)


def count(prediction: str, reference: str) -> float:
    """LongBench's count_score: the share of the numbers in the prediction that equal the reference."""
    numbers = _DIGITS.findall(prediction)
    return sum(n == str(reference) for n in numbers) / len(numbers) if numbers else 0.0


def code_sim(prediction: str, reference: str) -> float:
    """LongBench's code_sim_score: the first line of the prediction without a backtick, `#` or `//`, compared
    with the reference by difflib's similarity ratio (2 x matches / total length; LongBench's
    `fuzz.ratio` is the same ratio, x100 and rounded, when fuzzywuzzy runs without python-Levenshtein)."""
    line = next((x for x in prediction.lstrip("\n").split("\n") if "`" not in x and "#" not in x and "//" not in x), "")
    return difflib.SequenceMatcher(None, line, reference).ratio()


#: LongBench's English tasks -> metric (its `dataset2metric`); the Chinese ones need a word segmenter
LONGBENCH_TASKS = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1", "2wikimqa": "qa_f1",
    "musique": "qa_f1", "triviaqa": "qa_f1", "gov_report": "rouge_l", "qmsum": "rouge_l", "multi_news": "rouge_l",
    "samsum": "rouge_l", "trec": "classification", "passage_retrieval_en": "retrieval", "passage_count": "count",
    "lcc": "code_sim", "repobench-p": "code_sim",
}
LONGBENCH_CHINESE = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
#: tasks whose prediction LongBench cuts to its first line before scoring
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")


def longbench_score(metric: str, prediction: str, references: list[str], all_classes: list[str] | None = None,
                    first_line: bool = False) -> float:
    """LongBench's scorer for one prediction: leading whitespace stripped (and only the first line kept
    for `first_line` tasks), then the best score over the references."""
    prediction = prediction.lstrip()
    if first_line:
        prediction = prediction.split("\n")[0]
    fn = {"qa_f1": qa_f1, "rouge_l": rouge_l, "retrieval": retrieval, "count": count, "code_sim": code_sim}
    if metric == "classification":
        return max(classification(prediction, ref, all_classes or []) for ref in references)
    return max(fn[metric](prediction, ref) for ref in references)


def answer_is_final(metric: str, prediction: str) -> bool:
    """Whether `prediction` has given its final answer, so that decoding may stop once it is also right:
    a closed box for `boxed` / `trace` (models end there; a later box would replace it, but that is the
    model's business after the answer); never for `final_number` (every new number replaces the last one,
    and a trace passes through the answer's value on its way: only the end of the generation ends it);
    always for the string and passkey metrics (their score only grows)."""
    if metric in ("boxed", "trace"):
        return last_boxed(prediction) is not None
    return metric != "final_number"


def score_prediction(metric: str, prediction: str, references: list[str], all_classes: list[str] | None = None,
                     first_line: bool = False) -> dict[str, float]:
    """All scores of one prediction; `score` is the task's own metric (`all_classes`, `first_line`: for
    LongBench's metrics, see `longbench_score`)."""
    if metric in LONGBENCH_METRICS:
        value = longbench_score(metric, prediction, references, all_classes, first_line)
        return {"string_match_all": string_match_all(prediction, references),
                "string_match_part": string_match_part(prediction, references), metric: value, "score": value}
    scores = {
        "string_match_all": string_match_all(prediction, references),
        "string_match_part": string_match_part(prediction, references),
    }
    if metric == "passkey":
        exact, partial = passkey_scores(prediction, references[0])
        scores.update(passkey_exact=exact, passkey_partial=partial, score=exact)
    elif metric in ("boxed", "final_number", "trace"):
        finals = references[:1] if metric == "trace" else references
        boxed = last_boxed(prediction)
        scores["boxed"] = answer_matches(boxed, finals)
        scores["final_number"] = answer_matches(boxed if boxed is not None else last_number(prediction), finals)
        if metric == "trace":
            scores["trace_partial"] = trace_partial(prediction, references[1:])
        scores["score"] = scores["final_number" if metric == "final_number" else "boxed"]
    else:
        scores["score"] = scores[metric]
    return scores
