"""vLLM's GPU KV block layout (vLLM 0.32, FlashAttention and FlashInfer), as pure tensor functions.

One layer's cache is the logical view `(num_blocks, kv_heads, block_size, 2 * head_dim)` that vLLM's
`create_kv_cache_views` strides over one int8 buffer; both backends read token `j` of block `b`, KV head `h`
as `kv_cache[b, h, j]`: its key in `[:head_dim]`, its value in `[head_dim:]` (what `reshape_and_cache_flash`
writes). The physical order is a stride permutation (`vllm.v1.kv_cache_layout.KVCacheLayout`: NHD = LBNHC,
HND = LBHNC, and block-outermost ones), so these functions index the logical view only, never `.view()` its
memory: one file serves every such layout. Index tensors go to the cache's device; nothing here picks a
device (docs/vllm-gpu-design.md §3: no GPU path is switched on until one has run).

Token `i` of a request lives in block `block_ids[i // block_size]` at offset `i % block_size` (`slot_places`).
"""

from __future__ import annotations

import torch

from kvtrim.methods.base import check
from kvtrim.vllm.layout import slot_places

__all__ = ["check_views", "move_entries", "read_keys", "read_request", "request_key_logits", "slot_places",
           "table_key_logits", "write_entries"]

#: cache dtypes stored as plain values (a quantised cache needs its scales: refused)
PLAIN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_views(kv_caches: list[torch.Tensor], num_blocks: int, block_size: int) -> None:
    """Refuse, in one line, per-layer views these functions would misread: not 4-D, a first dimension other
    than the `num_blocks` manager blocks (kernel blocks split each block: `prepare_kernel_block_sizes`), a
    third other than `block_size`, an odd last dimension, or a quantised dtype."""
    for kv in kv_caches:
        check(kv.dim() == 4 and kv.shape[0] == num_blocks and kv.shape[2] == block_size,
              f"kvtrim reads vLLM's KV cache as (blocks={num_blocks}, heads, block_size={block_size}, 2 * head_dim), "
              f"got a layer view {tuple(kv.shape)} (kernel blocks smaller than vLLM's block are not supported)")
        check(kv.shape[-1] % 2 == 0 and kv.dtype in PLAIN_DTYPES,
              f"kvtrim reads K and V as halves of a {', '.join(map(str, PLAIN_DTYPES))} cache, got {kv.dtype} "
              f"with {kv.shape[-1]} elements per entry")


def _on(kv_cache: torch.Tensor, *index: torch.Tensor) -> list[torch.Tensor]:
    """`index` tensors on the cache's device (a no-op where they are already)."""
    return [i.to(kv_cache.device) for i in index]


def read_request(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `(kv_heads, n, head_dim)` of the first `n` stored tokens of a request whose blocks are
    `block_ids` `(num_request_blocks,)` int64 (views of one copy)."""
    nb, h, bs, two_d = kv_cache.shape
    used = -(-n // bs)
    (ids,) = _on(kv_cache, block_ids[:used])
    # the request's whole blocks (one copy, whatever the physical order), then head-major, token-major
    entries = kv_cache.index_select(0, ids).transpose(0, 1).reshape(h, used * bs, two_d)[:, :n]
    return entries[..., :two_d // 2], entries[..., two_d // 2:]


def read_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Keys `(kv_heads, n, head_dim)` of the first `n` stored tokens of a request whose blocks are `block_ids`
    (a copy): `read_request` without the values; only the key halves of the request's blocks are copied."""
    nb, h, bs, two_d = kv_cache.shape
    used = -(-n // bs)
    (ids,) = _on(kv_cache, block_ids[:used])
    return kv_cache[..., :two_d // 2].index_select(0, ids).transpose(0, 1).reshape(h, used * bs, -1)[:, :n]


def request_key_logits(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, n: int, query: torch.Tensor) -> torch.Tensor:
    """`QK^T` (unscaled, the cache's dtype) of one query per layer over the first `n` stored entries of a request
    whose blocks are `block_ids`, each layer of `kv_caches` read once as a batch row: only the key halves of the
    request's blocks are copied.

    Args:
        query: `(layers, q_heads, 1, head_dim)`, query head `i` reading KV head `i // (q_heads // kv_heads)`.
    Returns:
        `(layers, q_heads, 1, n)`.
    """
    nb, h, bs, two_d = kv_caches[0].shape
    d, used, layers = two_d // 2, -(-n // bs), len(kv_caches)
    (ids,) = _on(kv_caches[0], block_ids[:used])
    keys = torch.empty(layers, h, used, bs, d, dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    for kv, out in zip(kv_caches, keys):  # gathered straight into (head, block, slot, d): no permuted copy
        torch.index_select(kv[..., :d].transpose(0, 1), 1, ids, out=out)
    group = query.shape[1] // h
    q = query.to(keys.device).view(layers, h, group, d)
    logits = torch.matmul(q, keys.view(layers, h, used * bs, d).transpose(-1, -2))  # (layers, h, group, slots)
    return logits.view(layers, h * group, 1, used * bs)[..., :n]


def table_key_logits(kv_cache: torch.Tensor, block_table: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`kvtrim.vllm.layout.table_key_logits` on this layout (keys gathered straight into `(head, request, slot,
    d)`, one matmul).

    Returns:
        `(requests, q_heads, blocks * block_size)`, slot order.
    """
    nb, h, bs, two_d = kv_cache.shape
    d, (r, used) = two_d // 2, block_table.shape
    (ids,) = _on(kv_cache, block_table.flatten())
    keys = kv_cache[..., :d].transpose(0, 1).index_select(1, ids).view(h, r, used * bs, d)
    group = query.shape[1] // h
    q = query.to(keys.device).reshape(r, h, group, d)
    logits = torch.matmul(q, keys.permute(1, 0, 3, 2))  # (r, h, group, slots)
    return logits.reshape(r, h * group, used * bs)


def write_entries(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store single entries: `keys[i]`, `values[i]` `(m, head_dim)` as KV head `heads[i]`'s entry at the request's
    slot `slots[i]` (`(m,)` int64 each; in place). Compaction moves only the entries it must with it."""
    blk, off = slot_places(block_ids, slots, kv_cache.shape[2])
    blk, heads, off = _on(kv_cache, blk, heads, off)
    # key and value are one row of the view: one scatter
    kv_cache[blk, heads, off] = torch.cat([keys, values], dim=-1).to(kv_cache.device, kv_cache.dtype)


def move_entries(kv_cache: torch.Tensor, heads: torch.Tensor, source: tuple[torch.Tensor, torch.Tensor],
                 target: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy KV head `heads[i]`'s entry from `source` to `target` (`slot_places` of distinct slots), keys and
    values, in place: one gather and one scatter, nothing converted (same cache, same dtype)."""
    heads, src_blk, src_off, dst_blk, dst_off = _on(kv_cache, heads, *source, *target)
    kv_cache[dst_blk, heads, dst_off] = kv_cache[src_blk, heads, src_off]
