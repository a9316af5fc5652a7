"""Output folders of `kvtrim eval` / `kvtrim bench`: checked (created and written to) before any work,
so that a run never ends by failing to save what it measured."""

from __future__ import annotations

import os
import tempfile

from kvtrim.methods.base import KvtrimError


def prepare_out_dir(path: str, flag: str = "--out") -> str:
    """Create `path` if needed and prove that files can be written in it; a one-line error otherwise."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise KvtrimError(f"{flag} {path} names an existing file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise KvtrimError(f"{flag} {path} is not a writable folder: {err.strerror or err}") from None
    return path


def check_writable_file(path: str, flag: str) -> None:
    """A file about to be written: its folder must exist and take files, and it must not be a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise KvtrimError(f"{flag} {path} is a folder, not a file")
    if not os.path.isdir(folder):
        raise KvtrimError(f"{flag} {path}: folder {folder} does not exist")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise KvtrimError(f"{flag} {path}: cannot write in {folder}: {err.strerror or err}") from None
