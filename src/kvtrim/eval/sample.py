"""One evaluation sample, and the JSONL task-file format that stores samples.

A sample is split the way kvpress splits RULER: `context` (what gets compressed in the default,
query-agnostic protocol), `question` (appended after compression), `answer_prefix` (the start of the
assistant's answer, fed to the model before decoding), `answers` (reference strings).

Task file (`kvtrim eval --task-file F.jsonl`), one JSON object per line:

    {"context": "...", "question": "...", "answers": ["..."], "max_new_tokens": 32,
     "answer_prefix": "...", "task": "my_task", "length": 4096, "depth": 0.5, "id": "my_task-0",
     "metric": "string_match_all"}

Required: `context`, `question`, `answers` (a string or a list; `outputs` and `answer` are accepted as
aliases, as in RULER and kvpress exports), `max_new_tokens`. Optional: `answer_prefix` (default ""),
`task` (default "custom"), `length` (the target length in tokens, used for grouping in reports;
default: measured), `depth` (0..1, needle depth, for heat maps), `id` (default `<task>-<line>`),
`metric` (`string_match_all` (default), `string_match_part`, `passkey`, `boxed`, `final_number`, `trace`;
see `kvtrim.eval.scoring`), `meta` (an object, kept as is).

Reasoning data (GSM8K, MATH500 exports): put the problem in `context` (or all of it in `question` with an
empty `context`, to compress nothing before decoding starts), the instruction in `question`, e.g.
"Solve the problem step by step and put the final answer in \\boxed{}.", the reference answer alone in
`answers` ("18", "\\frac{1}{2}"), `metric` `final_number` (GSM8K: the boxed answer, else the last number)
or `boxed` (MATH: the boxed answer only), and a `max_new_tokens` long enough for the reasoning (any
positive integer; thousands for R1-style traces). A `trace` row needs at least two answers: the final
answer, then the value after each step (`kvtrim.eval.reasoning` writes these); step values must be numbers.
`tests/data/reasoning_tasks.jsonl` is a small example.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtrim.eval.scoring import METRICS, last_number
from kvtrim.methods.base import KvtrimError, check


@dataclass
class Sample:
    id: str
    task: str
    context: str
    question: str
    answers: list[str]
    max_new_tokens: int
    answer_prefix: str = ""
    metric: str = "string_match_all"
    length: int = 0  # target length in tokens (prompt + max_new_tokens, RULER's convention); 0 = unknown
    depth: float | None = None  # needle depth in [0, 1] where it is controlled
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)


def sample_from_dict(row: dict[str, Any], default_id: str) -> Sample:
    """Build a `Sample` from a task-file row (see the module docstring); one-line errors for bad rows."""
    check(isinstance(row, dict), f"{default_id}: expected a JSON object")
    for key in ("context", "question"):
        check(isinstance(row.get(key), str), f"{default_id}: missing or non-string '{key}'")
    answers = next((row[k] for k in ("answers", "outputs", "answer") if k in row), None)
    if isinstance(answers, str):
        answers = [answers]
    check(
        isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers),
        f"{default_id}: 'answers' must be a non-empty string or list of strings",
    )
    max_new = row.get("max_new_tokens")
    check(_is_int(max_new) and max_new >= 1,
          f"{default_id}: 'max_new_tokens' must be a positive integer, got {max_new!r}")
    metric = row.get("metric", "string_match_all")
    check(metric in METRICS, f"{default_id}: unknown metric '{metric}' (use one of {', '.join(METRICS)})")
    if metric == "trace":
        check(len(answers) >= 2 and all(last_number(a) == a.strip() for a in answers[1:]),
              f"{default_id}: a 'trace' row needs answers [final, value after step 1, step 2, ...] (numbers)")
    depth = row.get("depth")
    check(depth is None or (_is_number(depth) and 0 <= depth <= 1),
          f"{default_id}: 'depth' must be a number in [0, 1], got {depth!r}")
    length = row.get("length", 0)
    check(length is None or (_is_int(length) and length >= 0),
          f"{default_id}: 'length' must be a non-negative integer (tokens), got {length!r}")
    meta = row.get("meta", {})
    check(meta is None or isinstance(meta, dict), f"{default_id}: 'meta' must be a JSON object, got {meta!r}")
    for key in ("task", "id", "answer_prefix"):
        value = row.get(key)
        check(value is None or isinstance(value, (str, int)) and not isinstance(value, bool),
              f"{default_id}: '{key}' must be a string, got {value!r}")
    task = str(row.get("task", "custom"))
    return Sample(
        id=str(row.get("id", default_id)), task=task, context=row["context"], question=row["question"],
        answers=answers, max_new_tokens=max_new, answer_prefix=str(row.get("answer_prefix", "") or ""),
        metric=metric, length=length or 0, depth=None if depth is None else float(depth),
        meta=dict(meta or {}),
    )


def _is_int(value) -> bool:
    """An integer, not a bool (JSON `true` would otherwise count as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_task_file(path: str) -> list[Sample]:
    """Samples of a JSONL task file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as err:
        raise KvtrimError(f"cannot read task file {path}: {err}") from None
    samples = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise KvtrimError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        task = row.get("task", "custom") if isinstance(row, dict) else "custom"
        samples.append(sample_from_dict(row, f"{task}-{number - 1}"))
    check(bool(samples), f"task file {path} holds no samples")
    ids = [s.id for s in samples]
    check(len(set(ids)) == len(ids), f"task file {path}: sample ids are not unique")
    return samples


def write_task_file(path: str, samples: list[Sample]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(s.to_json() + "\n")
