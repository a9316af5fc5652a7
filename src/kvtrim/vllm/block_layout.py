"""Which KV block layout the compaction reads and writes: one protocol, one chooser.

A layout is a module of pure tensor functions over one layer's logical cache `(num_blocks, kv_heads,
block_size, 2 * head_dim)`: `kvtrim.vllm.layout` (vLLM's CPU kernels "vec" and "vec16", keys stored
transposed), `kvtrim.vllm.layout_amx` (the CPU kernel "amx": keys and values packed in pairs for AMX tiles) or
`kvtrim.vllm.layout_flash` (FlashAttention / FlashInfer, token-major, any `KVCacheLayout` stride permutation).
`kvtrim.vllm.compact` takes one as its `layout` argument. Choosing the flash module switches nothing on: the
worker runs on vLLM's CPU build only (docs/vllm-gpu-design.md §5).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import torch

from kvtrim.methods.base import check
from kvtrim.vllm import layout as cpu_vec
from kvtrim.vllm import layout_amx, layout_flash

#: vLLM's attention backends (`AttentionBackendEnum` names) by the layout module that reads their cache
CPU_BACKEND = "CPU_ATTN"
FLASH_BACKENDS = ("FLASH_ATTN", "FLASHINFER")

#: vLLM's CPU attention kernels (`_get_attn_isa`'s names) by the layout module that reads their cache (each
#: measured with the kernel's own writer: tests/test_vllm_layout.py, tests/test_vllm_layout_amx.py); the others
#: ("neon", "vsx", "vxe", "rvv") are refused until measured
CPU_ISA_LAYOUTS = {"vec": cpu_vec, "vec16": cpu_vec, layout_amx.ISA: layout_amx}

#: `vllm.v1.kv_cache_layout.KVCacheLayout` members whose per-layer view is the token-major `(B, H, N, 2D)` of
#: `layout_flash` (each tested on the CPU against a reference writer: tests/test_vllm_layout_flash.py)
FLASH_KV_CACHE_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@runtime_checkable
class BlockLayout(Protocol):
    """What the compaction needs of a layout (the functions of `kvtrim.vllm.layout`, same signatures)."""

    def read_request(self, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                     n: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def read_keys(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> torch.Tensor: ...

    def request_key_logits(self, kv_caches: list[torch.Tensor], block_ids: torch.Tensor, n: int,
                           query: torch.Tensor) -> torch.Tensor: ...

    def table_key_logits(self, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         query: torch.Tensor) -> torch.Tensor: ...

    def write_entries(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor,
                      slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def move_entries(self, kv_cache: torch.Tensor, heads: torch.Tensor, source: tuple[torch.Tensor, torch.Tensor],
                     target: tuple[torch.Tensor, torch.Tensor]) -> None: ...


def block_layout(backend: str, *, isa: str | None = None, kv_cache_layout: Any = None) -> ModuleType:
    """The layout module for vLLM's attention `backend` (an `AttentionBackendEnum` name): for "CPU_ATTN" the one
    of kernel `isa` in `CPU_ISA_LAYOUTS`, `kvtrim.vllm.layout_flash` for "FLASH_ATTN" / "FLASHINFER" with a
    `kv_cache_layout` (a `KVCacheLayout` or its name) in `FLASH_KV_CACHE_LAYOUTS`; anything else is refused
    in one line."""
    if backend == CPU_BACKEND:
        check(isa in CPU_ISA_LAYOUTS,
              f"kvtrim's vLLM worker knows the KV layouts of the CPU attention kernels "
              f"{', '.join(repr(k) for k in CPU_ISA_LAYOUTS)} only, this machine uses {isa!r}")
        return CPU_ISA_LAYOUTS[isa]
    check(backend in FLASH_BACKENDS,
          f"kvtrim knows the KV block layouts of vLLM's {', '.join((CPU_BACKEND, *FLASH_BACKENDS))} attention "
          f"backends only, got '{backend}'")
    name = getattr(kv_cache_layout, "name", kv_cache_layout)
    check(name in FLASH_KV_CACHE_LAYOUTS,
          f"kvtrim reads {backend}'s cache in the KV cache layouts {', '.join(FLASH_KV_CACHE_LAYOUTS)} only, "
          f"got {name}")
    return layout_flash
