"""Optional dependencies: a one-line error naming the extra to install when one is missing.

The core (`TrimCache`, the methods, `generate`) needs only torch and transformers. Plots need
`kvtrim[eval]` (matplotlib); converting the named GGUF models needs `kvtrim[models]` (gguf, accelerate); `kvtrim eval --ray` needs `kvtrim[ray]`; `kvtrim eval --dataset` on
parquet files or save_to_disk folders needs `kvtrim[data]` (pyarrow, datasets).
"""

from __future__ import annotations

import importlib.util

from kvtrim.methods.base import KvtrimError

EXTRAS = {"eval": ("matplotlib",), "models": ("gguf", "accelerate"), "ray": ("ray",), "data": ("datasets", "pyarrow")}


def require(module: str, extra: str, purpose: str) -> None:
    """Raise a one-line `KvtrimError` unless `module` is importable (checked without importing it)."""
    if importlib.util.find_spec(module) is None:
        raise KvtrimError(f"{purpose} needs {module}, which is not installed: pip install 'kvtrim[{extra}]'")
