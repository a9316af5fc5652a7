"""The append-only JSONL files of an eval folder (`results.jsonl`, `invocations.jsonl`).

kvtrim writes them one complete line at a time (then flushes), so the only damage an interruption can
leave is a cut *last* line. Reading drops such a fragment with a warning; `repair=True` also cuts it off
the file (and gives a complete last line its missing newline), so that the next appended line starts on
a line of its own. Any other line that is not a JSON object was not written that way (an edit, a merge):
that is an error naming the line, never a silent skip.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

from kvtrim.methods.base import KvtrimError


def warn(message: str) -> None:
    print(f"kvtrim: warning: {message}", file=sys.stderr, flush=True)


def read_jsonl(path: str, repair: bool = False, on_warning: Callable[[str], None] | None = warn) -> list[dict]:
    """The JSON objects of `path`, one per non-empty line ([] when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[dict] = []
    offset = 0
    cut_at = None
    for i, raw in enumerate(lines):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError from a cut multi-byte character
            if i == last:
                cut_at = start
                break
            raise KvtrimError(f"{path}:{i + 1}: not a valid JSON line ({err}); only a last line can be cut by an "
                              "interruption, so this file was changed by hand: fix or remove that line") from None
        if not isinstance(row, dict):
            raise KvtrimError(f"{path}:{i + 1}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    if cut_at is not None:
        if on_warning:
            on_warning(f"{path}: dropped a cut last line ({len(data) - cut_at} bytes) left by an interrupted run"
                       + ("" if repair else "; it is removed when the run resumes"))
        if repair:
            with open(path, "r+b") as f:
                f.truncate(cut_at)
    elif repair and data and not data.endswith(b"\n"):
        with open(path, "ab") as f:  # a complete last line whose newline was not written
            f.write(b"\n")
    return rows


def append_jsonl(path: str, row: dict) -> None:
    """Append one row (repairing a cut last line first)."""
    read_jsonl(path, repair=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
