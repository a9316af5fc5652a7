"""The field's datasets, read from disk (`kvtrim eval --dataset PATH`): kvpress's format and its kin.

kvpress publishes its benchmarks (RULER, LongBench, ...) as tables with the columns `context`,
`question`, `answer_prefix`, `answer` (or `answers`: a string or a list), `max_new_tokens`, and often
`task` (the sub-task's name) and `all_classes` (LongBench's classification tasks). This module reads such
a table from
* a parquet file (`*.parquet`), or a folder of them (the Hub's layout, `data/test-00000-of-00001.parquet`:
  `--split test` keeps the files whose name starts with the split),
* a `datasets` folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (`--split` picks a
  split of a DatasetDict; needed when it has several),
* a JSONL file (`*.jsonl`, one object per line, the same columns).
`columns` maps kvtrim's names to the file's where they differ (`--columns context=input,answer=answers`).
kvtrim never downloads: whoever has Hub access fetches the files (e.g. `huggingface-cli download
simonjegou/ruler --repo-type dataset`) and points `--dataset` at them.

Each row becomes a `Sample`. Its metric is the task's official one: LongBench's English tasks by name
(`kvtrim.eval.scoring.LONGBENCH_TASKS`: qa_f1, rouge_l, classification, retrieval, count, code_sim; a
`-e` suffix, LongBench-E, is dropped), RULER's QA tasks (`qa_*`) `string_match_part`, every other task
`string_match_all` (RULER's default); `metric=` overrides it. LongBench's Chinese tasks need a word
segmenter kvtrim does not ship: refused. Rows that share a context are compressed once and answer all
their questions (`kvtrim.eval.runner.pending_units`).

Needs `kvtrim[data]` (pyarrow for parquet; datasets for save_to_disk folders); JSONL needs nothing.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from kvtrim.eval.sample import Sample
from kvtrim.eval.scoring import FIRST_LINE_TASKS, LONGBENCH_CHINESE, LONGBENCH_TASKS, METRICS
from kvtrim.extras import require
from kvtrim.methods.base import KvtrimError, check

#: kvtrim's names for the columns it reads; the first name found in a row is used
FIELDS = {
    "context": ("context",), "question": ("question",), "answer_prefix": ("answer_prefix",),
    "answer": ("answer", "answers", "outputs"), "max_new_tokens": ("max_new_tokens",), "task": ("task",),
    "id": ("id", "_id"), "all_classes": ("all_classes",),
}


def parse_columns(text: str | None) -> dict[str, str]:
    """`context=input,answer=answers` -> {"context": "input", "answer": "answers"} (one-line errors)."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        check(sep == "=" and key and value, f"--columns: expected FIELD=COLUMN, got '{item.strip()}'")
        check(key in FIELDS, f"--columns: unknown field '{key}' (fields: {', '.join(FIELDS)})")
        check(key not in out, f"--columns: field '{key}' given twice")
        out[key] = value
    return out


def read_rows(path: str, split: str | None = None) -> tuple[list[dict[str, Any]], str]:
    """The rows of the table at `path` and a default task name (the file's or folder's name)."""
    check(os.path.exists(path), f"--dataset {path} does not exist")
    name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
            return _read_saved(path, split), name
        files = sorted(glob.glob(os.path.join(path, "**", "*.parquet"), recursive=True))
        if split is not None:
            files = [f for f in files if os.path.basename(f).startswith(split)]
        check(bool(files), f"--dataset {path}: no save_to_disk dataset and no parquet files"
                           + (f" of split '{split}'" if split else ""))
        return [row for f in files for row in _read_parquet(f)], name
    check(split is None, f"--split is for a folder (save_to_disk or parquet files), not the file {path}")
    if path.endswith(".parquet"):
        return _read_parquet(path), name
    if path.endswith(".jsonl") or path.endswith(".json"):
        return _read_jsonl(path), name
    raise KvtrimError(f"--dataset {path}: expected a .parquet or .jsonl file, or a folder")


def _read_parquet(path: str) -> list[dict]:
    require("pyarrow", "data", f"reading {path}")
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow's errors have no common base worth naming
        raise KvtrimError(f"cannot read parquet file {path}: {err}".splitlines()[0]) from None


def _read_saved(path: str, split: str | None) -> list[dict]:
    require("datasets", "data", f"reading the save_to_disk folder {path}")
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        data = load_from_disk(path)
    except Exception as err:
        raise KvtrimError(f"cannot read the save_to_disk folder {path}: {err}".splitlines()[0]) from None
    if isinstance(data, DatasetDict):
        splits = list(data)
        if split is None:
            check(len(splits) == 1, f"--dataset {path} has splits {', '.join(splits)}: choose one with --split")
            split = splits[0]
        check(split in data, f"--dataset {path} has no split '{split}' (splits: {', '.join(splits)})")
        data = data[split]
    else:
        check(split is None, f"--dataset {path} is one split (a Dataset): drop --split")
    assert isinstance(data, Dataset)
    return data.to_list()


def _read_jsonl(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as err:
        raise KvtrimError(f"cannot read {path}: {err}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise KvtrimError(f"{path}:{number}: invalid JSON ({err.msg})") from None
    return rows


def task_metric(task: str) -> str:
    """The official metric of `task` (see the module docstring)."""
    base = task.removesuffix("-e")
    check(base not in LONGBENCH_CHINESE, f"task {task}: LongBench's Chinese metrics need a word segmenter (jieba) "
                                         "that kvtrim does not ship; give --metric to score it otherwise")
    if base in LONGBENCH_TASKS:
        return LONGBENCH_TASKS[base]
    return "string_match_part" if base.startswith("qa") else "string_match_all"


def _get(row: dict, field: str, columns: dict[str, str]):
    if field in columns:
        return row.get(columns[field]), columns[field] in row
    for name in FIELDS[field]:
        if name in row:
            return row[name], True
    return None, False


def _text(value, where: str, field: str) -> str:
    check(value is None or isinstance(value, str), f"{where}: '{field}' must be a string, got {type(value).__name__}")
    return value or ""


def rows_to_samples(rows: list[dict], default_task: str, columns: dict[str, str] | None = None,
                    max_new_tokens: int | None = None, metric: str | None = None,
                    per_task: int | None = None) -> list[Sample]:
    """Samples of kvpress-format rows. `max_new_tokens`: used where a row has none (and then required);
    `per_task`: keep the first that many rows of each task."""
    columns = columns or {}
    check(metric is None or metric in METRICS, f"--metric: unknown metric '{metric}' (use one of {', '.join(METRICS)})")
    check(bool(rows), "the dataset holds no rows")
    for field, column in columns.items():
        check(column in rows[0], f"--columns {field}={column}: the dataset has no column '{column}' "
                                 f"(columns: {', '.join(rows[0])})")
    samples, taken = [], {}
    for index, row in enumerate(rows):
        task = str(_get(row, "task", columns)[0] or default_task)
        if per_task is not None and taken.get(task, 0) >= per_task:
            continue
        taken[task] = taken.get(task, 0) + 1
        where = f"row {index} ({task})"
        context, has_context = _get(row, "context", columns)
        check(has_context, f"{where}: no 'context' column (map one with --columns context=NAME)")
        question = _text(_get(row, "question", columns)[0], where, "question")
        prefix = _text(_get(row, "answer_prefix", columns)[0], where, "answer_prefix")
        answers, has_answer = _get(row, "answer", columns)
        check(has_answer, f"{where}: no 'answer' / 'answers' column (map one with --columns answer=NAME)")
        if isinstance(answers, (str, int, float)) and not isinstance(answers, bool):
            answers = [answers]
        check(isinstance(answers, (list, tuple)) and len(answers) > 0,
              f"{where}: 'answer' must be a string or a non-empty list, got {answers!r}"[:200])
        answers = [str(a) for a in answers]
        cap, _ = _get(row, "max_new_tokens", columns)
        if cap is None:
            check(max_new_tokens is not None, f"{where}: no 'max_new_tokens': give --max-new-tokens")
            cap = max_new_tokens
        check(isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1,
              f"{where}: 'max_new_tokens' must be a positive integer, got {cap!r}")
        chosen = metric or task_metric(task)
        meta: dict[str, Any] = {"row": index}
        classes, _ = _get(row, "all_classes", columns)
        if classes is not None:
            meta["all_classes"] = [str(c) for c in classes]
        check(chosen != "classification" or "all_classes" in meta,
              f"{where}: the classification metric needs the 'all_classes' column")
        if task.removesuffix("-e") in FIRST_LINE_TASKS:
            meta["first_line"] = True  # LongBench scores only the first line of these tasks' answers
        if "length" in row:
            meta["length"] = row["length"]  # the dataset's own measure (LongBench: words), not tokens
        sample_id = _get(row, "id", columns)[0]
        samples.append(Sample(
            id=f"{task}/{sample_id if sample_id is not None else index}", task=task,
            context=_text(context, where, "context"), question=question, answers=answers, max_new_tokens=cap,
            answer_prefix=prefix, metric=chosen, meta=meta,
        ))
    ids = [s.id for s in samples]
    check(len(set(ids)) == len(ids), "the dataset's sample ids are not unique (map an id column with --columns id=NAME)")
    return samples


def read_dataset(path: str, split: str | None = None, columns: dict[str, str] | None = None,
                 max_new_tokens: int | None = None, metric: str | None = None,
                 per_task: int | None = None) -> list[Sample]:
    """The samples of the dataset at `path` (see the module docstring)."""
    rows, name = read_rows(path, split)
    return rows_to_samples(rows, name, columns, max_new_tokens, metric, per_task)
