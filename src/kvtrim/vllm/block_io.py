"""Reads and writes of a request's entries in its vLLM blocks: the stored keys and values a compaction
reads, the moves that put the kept entries into the first slots (`fill_holes`), and H2O's prompt
attention sums read chunk by chunk. `layout`: how the caches store their blocks
(`kvtrim.vllm.block_layout`; default vLLM's CPU kernel "vec")."""

from __future__ import annotations

import torch

from kvtrim.methods.base import EvictionMethod
from kvtrim.methods.h2o import prompt_attention_sums
from kvtrim.vllm import layout as cpu_vec
from kvtrim.vllm.block_layout import BlockLayout
from kvtrim.vllm.layout import slot_places


def fill_holes(kept: torch.Tensor, n_keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which entries move so that the `n_keep` kept entries of each row of `kept` `(kv_heads, stored)` (bool,
    `n_keep` True per row) occupy slots `0..n_keep - 1`: each slot below `n_keep` that lost its entry takes a
    kept entry from a slot at or past `n_keep` (both in slot order). Returns the moves, `heads`, `from_slots`,
    `to_slots` `(moves,)` each, and `order` `(kv_heads, n_keep)`: afterwards slot `j` of head `i` holds the
    entry that was at slot `order[i, j]`."""
    holes = (~kept[:, :n_keep]).nonzero()  # (moves, 2): row-major, so each head's holes in slot order ...
    sources = kept[:, n_keep:].nonzero()  # ... and its sources, the same number per head
    heads, to_slots, from_slots = holes[:, 0], holes[:, 1], sources[:, 1] + n_keep
    order = torch.arange(n_keep).expand(kept.shape[0], -1).clone()
    order[heads, to_slots] = from_slots
    return heads, from_slots, to_slots, order


def add_prompt_sums(sums: list[torch.Tensor], kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                    queries: list[torch.Tensor], computed: int, scales: list[float], block: int,
                    layout: BlockLayout = cpu_vec) -> None:
    """Add to each layer's `sums` `(kv_heads, prompt)` float32 the column sums of the causal attention of a prefill
    chunk's queries `(q_heads, rows, head_dim)` (positions `computed .. computed + rows - 1`) over the request's
    keys up to the chunk's last position, by H2O's own rule (`prompt_attention_sums`, in blocks of `block` query
    rows). The sums are additive over query rows: chunk by chunk they are the whole prompt's, without holding its
    queries. Nothing is compacted before such a prompt ends (it is one block): entry `i` is token `i`. `layout`:
    how the caches store their blocks (`kvtrim.vllm.block_layout`)."""
    visible = computed + queries[0].shape[1]
    for kv, q, scale, total in zip(kv_caches, queries, scales, sums):
        keys = layout.read_keys(kv, block_ids, visible)  # (kv_heads, visible, head_dim)
        total[:, :visible] += prompt_attention_sums(q[None], keys[None], scale, block)[0]



def layers_as_blocks(kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """Every layer's cache `(num_blocks, ...)` as one view `(layers * num_blocks, ...)` (layer `l`'s block `b` is
    its block `l * num_blocks + b`), when the layers lie back to back in one allocation, as vLLM places them
    (`KVCacheTensor`: one backing allocation, layer-outermost); None otherwise. One indexed copy then moves the
    entries of every layer (`move_layers_entries`, `copy_blocks`) instead of one per layer."""
    global _STACKED
    first = kv_caches[0]
    if _STACKED[0] is kv_caches and _STACKED[1] == (len(kv_caches), first.data_ptr(), kv_caches[-1].data_ptr()):
        return _STACKED[2]  # the worker's list, asked at every compaction
    nb, step, storage = first.shape[0], first.shape[0] * first.stride(0), first.untyped_storage().data_ptr()
    stacked = None
    if all(kv.shape == first.shape and kv.stride() == first.stride() and kv.dtype == first.dtype
           and kv.untyped_storage().data_ptr() == storage and kv.storage_offset() == first.storage_offset() + idx * step
           for idx, kv in enumerate(kv_caches)):
        stacked = first.as_strided((len(kv_caches) * nb, *first.shape[1:]), first.stride(), first.storage_offset())
    _STACKED = (kv_caches, (len(kv_caches), first.data_ptr(), kv_caches[-1].data_ptr()), stacked)
    return stacked


#: the last list `layers_as_blocks` was asked about, its length and first and last layers' addresses, and its answer
_STACKED: tuple = (None, None, None)


def layer_blocks(blocks: torch.Tensor, layers: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The blocks `blocks` of layers `layers` (broadcast together) as blocks of `layers_as_blocks`' view."""
    return blocks + layers * num_blocks


def copy_blocks(kv_caches: list[torch.Tensor], sources: torch.Tensor, targets: torch.Tensor) -> None:
    """Copy blocks `sources[i]` into blocks `targets[i]` `(m,)` in every layer's cache (whole blocks: the same
    in any layout, whose caches are `(num_blocks, ...)` views): a copy on write before a compaction writes them."""
    stacked = layers_as_blocks(kv_caches)
    if stacked is not None:  # one copy for every layer
        layers = torch.arange(len(kv_caches))[:, None]
        nb = kv_caches[0].shape[0]
        stacked.index_copy_(0, layer_blocks(targets, layers, nb).flatten(),
                            stacked.index_select(0, layer_blocks(sources, layers, nb).flatten()))
        return
    for kv in kv_caches:
        kv.index_copy_(0, targets, kv.index_select(0, sources))


def read_stored(layout: BlockLayout, method: EvictionMethod, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's first `n` stored keys and values `(h, n, d)` in slot order; keys and None for a method that reads
    no values (`reads_values`): it gets stand-ins (`decide`) and its kept entries move inside the pool
    (`store_moves`)."""
    if method.reads_values:
        return layout.read_request(kv_cache, block_ids, n)
    return layout.read_keys(kv_cache, block_ids, n), None


def store_moves(layout: BlockLayout, kv_cache: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor,
                from_slots: torch.Tensor, to_slots: torch.Tensor, keys: torch.Tensor | None = None,
                values: torch.Tensor | None = None) -> None:
    """Put KV head `heads[i]`'s entry at slot `from_slots[i]` into slot `to_slots[i]` of one layer: written from the
    copies read (`keys`, `values` `(h, stored, d)`, slot order), or, when its values were not read, copied inside
    the pool."""
    if values is None:
        block_size = kv_cache.shape[2]
        layout.move_entries(kv_cache, heads, slot_places(block_ids, from_slots, block_size),
                            slot_places(block_ids, to_slots, block_size))
    else:
        layout.write_entries(kv_cache, block_ids, heads, to_slots, keys[heads, from_slots], values[heads, from_slots])


def fill_layers_holes(kept: torch.Tensor, n_keep: int) -> tuple[list[tuple], torch.Tensor]:
    """`fill_holes` for a batch of layers `kept` `(layers, kv_heads, stored)`: each layer's moves `(layer, heads,
    from_slots, to_slots)` (layers with none left out) and `order` `(layers, kv_heads, n_keep)`."""
    n_layers, h, stored = kept.shape
    rows, from_slots, to_slots, order = fill_holes(kept.view(n_layers * h, stored), n_keep)  # rows in layer order
    moves = []
    if rows.numel():
        per_layer = torch.bincount(rows // h, minlength=n_layers).tolist()
        for idx, (r, f, t) in enumerate(zip(rows.split(per_layer), from_slots.split(per_layer),
                                            to_slots.split(per_layer))):
            if r.numel():
                moves.append((idx, r - idx * h, f, t))
    return moves, order.view(n_layers, h, n_keep)


def move_layers_entries(layout: BlockLayout, kv_caches: list[torch.Tensor], block_ids: torch.Tensor, kept: torch.Tensor,
                        n_keep: int) -> torch.Tensor:
    """`fill_holes` in every layer of `kept` `(layers, kv_heads, stored)` of a method whose values were not read:
    the kept entries past `n_keep` copied inside the pool into the slots below it that lost theirs
    (`move_slots`). Returns `order` `(layers, kv_heads, n_keep)`."""
    n_layers, h, stored = kept.shape
    rows, from_slots, to_slots, order = fill_holes(kept.view(n_layers * h, stored), n_keep)  # rows in layer order
    if rows.numel():
        move_slots(layout, kv_caches, block_ids, rows // h, rows % h, from_slots, to_slots)
    return order.view(n_layers, h, n_keep)


def move_layers_into(layout: BlockLayout, kv_caches: list[torch.Tensor], block_ids: torch.Tensor,
                     order: torch.Tensor) -> None:
    """Put each layer's and KV head's kept entries in the order `order` `(layers, kv_heads, n_keep)` says: afterwards
    slot `j` holds the entry that was at slot `order[..., j]` (distinct per row); only the entries whose slot
    changes are copied, inside the pool (`move_slots`: every source is read before any slot is written, so a slot
    may be both)."""
    n_layers, h, n_keep = order.shape
    flat = order.reshape(n_layers * h, n_keep)
    rows, to_slots = (flat != torch.arange(n_keep)).nonzero(as_tuple=True)  # rows in layer order
    if rows.numel():
        move_slots(layout, kv_caches, block_ids, rows // h, rows % h, flat[rows, to_slots], to_slots)


def move_slots(layout: BlockLayout, kv_caches: list[torch.Tensor], block_ids: torch.Tensor, layers: torch.Tensor,
               heads: torch.Tensor, from_slots: torch.Tensor, to_slots: torch.Tensor) -> None:
    """Copy the entry of KV head `heads[i]` of layer `layers[i]` (ascending) at the request's slot `from_slots[i]`
    into its slot `to_slots[i]` (all `(m,)`), inside the pool: one copy for every layer when they lie back to back
    (`layers_as_blocks`), else one per layer; the places of every move worked out at once."""
    move_table_slots(layout, kv_caches, block_ids[None], torch.zeros_like(layers), layers, heads, from_slots, to_slots)


def move_table_slots(layout: BlockLayout, kv_caches: list[torch.Tensor], tables: torch.Tensor, requests: torch.Tensor,
                     layers: torch.Tensor, heads: torch.Tensor, from_slots: torch.Tensor,
                     to_slots: torch.Tensor) -> None:
    """`move_slots` for the entries of many requests at once: move `i` is request `requests[i]`'s, whose blocks are
    row `requests[i]` of `tables` `(requests, U)` (a shorter row padded with any block: only its slots' own blocks
    are read)."""
    block_size = kv_caches[0].shape[2]
    source = tables[requests, from_slots // block_size], from_slots % block_size
    target = tables[requests, to_slots // block_size], to_slots % block_size
    stacked = layers_as_blocks(kv_caches)
    if stacked is not None:
        nb = kv_caches[0].shape[0]
        layout.move_entries(stacked, heads, (layer_blocks(source[0], layers, nb), source[1]),
                            (layer_blocks(target[0], layers, nb), target[1]))
        return
    for idx, kv in enumerate(kv_caches):
        mine = (layers == idx).nonzero()[:, 0]
        if mine.numel():
            layout.move_entries(kv, heads[mine], (source[0][mine], source[1][mine]), (target[0][mine], target[1][mine]))
