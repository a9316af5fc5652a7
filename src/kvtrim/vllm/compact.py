"""One request's compaction: the kept positions chosen by a `TrimCache`, applied to its vLLM blocks.

The method is run exactly as `model.generate(..., cache=TrimCache(method))` runs it on a prompt fed in one
forward that ends the prompt (`TrimCache.phase(PREFILL, ends_prompt=True)`), on the keys and values vLLM
stored: no method is implemented a second time. The engine attended to the whole prompt before this
(attend, then evict), as the one-shot prefill does.
"""

from __future__ import annotations

import torch

from kvtrim.cache import TrimCache
from kvtrim.methods.base import EvictionMethod, Phase, check
from kvtrim.vllm.layout import read_request, write_request


def kept_positions(method: EvictionMethod, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Per layer, the positions `(kv_heads, n_keep)` (ascending) that `method` keeps of a prompt whose keys and
    values per layer are `layers[i]` = `(kv_heads, n, head_dim)` each; every layer must keep the same count."""
    cache = TrimCache(method)
    with cache.phase(Phase.PREFILL, ends_prompt=True):
        for idx, (k, v) in enumerate(layers):
            cache.update(k[None], v[None], idx)
    kept = []
    for layer in cache.trim_layers():
        pos = layer.kept_positions()
        check(not layer.is_ragged, f"{type(method).__name__} kept different numbers of entries per KV head, which "
                                   "vLLM's shared block table cannot hold")
        kept.append(pos[0])
    counts = {p.shape[-1] for p in kept}
    check(len(counts) == 1, f"{type(method).__name__} kept different numbers of entries per layer ({sorted(counts)})")
    return kept


def entries_discarded(method: EvictionMethod, prompt_tokens: int) -> int:
    """How many of a `prompt_tokens`-entry prompt's entries `method` discards, known before the keys are: the
    methods the engine runs (`kvtrim.vllm.spec`) keep a number that depends on the length only, so the method
    runs on stand-in keys of that length (one layer, one KV head). The scheduler frees blocks by it; the worker
    checks its real compaction against it."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, prompt_tokens, 8, generator=g)
    return prompt_tokens - kept_positions(method, [(k, v)])[0].shape[-1]


def blocks_needed(entries: int, block_size: int) -> int:
    """Blocks that hold a request's first `entries` stored entries (what it keeps after a compaction)."""
    return -(-entries // block_size)


def compact_request(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, prompt_tokens: int, stored: int,
                    method: EvictionMethod) -> int:
    """Evict from the request's first `prompt_tokens` stored entries (its prompt) with `method`, in every layer's
    cache `(num_blocks, kv_heads, block_size, 2 * head_dim)`; the `stored - prompt_tokens` entries after the
    prompt (a recomputed request's generated tokens) move down behind the kept ones. Returns the number of
    entries discarded (the same in every layer and head)."""
    layers = [read_request(kv, block_ids, stored) for kv in kv_caches]
    kept = kept_positions(method, [(k[:, :prompt_tokens], v[:, :prompt_tokens]) for k, v in layers])
    n_keep = kept[0].shape[-1]
    if n_keep == prompt_tokens:
        return 0
    tail = torch.arange(prompt_tokens, stored).expand(kept[0].shape[0], -1)
    for kv, (k, v), pos in zip(kv_caches, layers, kept):
        idx = torch.cat([pos, tail], dim=-1)[..., None].expand(-1, -1, k.shape[-1])  # (h, m, d)
        write_request(kv, block_ids, k.gather(1, idx), v.gather(1, idx))
    return prompt_tokens - n_keep
