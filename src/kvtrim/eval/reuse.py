"""Prefill once, evaluate many methods: replay a stored full prefill into each method's cache.

Why it is exact. With a one-shot prefill, kvtrim's cache layers "attend, then evict": every layer's
attention sees the whole prompt whatever the method, so the hidden states, the keys and values written
to the cache and the queries handed to the method are the same for every method. The only thing a
method changes is which entries it keeps. So the prompt is run once into a full cache (recording the
post-RoPE queries and the softmax scale each layer hands over when some method needs them), and for
each method a fresh `TrimCache` is fed the stored per-layer keys and values through `Cache.update`
(one forward's worth of entries, true positions 0..n-1) followed, for methods that wait for their
attention, by `after_attention(queries, None, scale)` - exactly the calls the model makes in the direct
path. Decoding then proceeds on that cache as usual.

Which methods can reuse the prefill (`reuses_prefill`):
* a method class may say so itself with a class attribute `reusable_prefill = True/False`;
* otherwise: yes when the method's prefill is one-shot (`kvtrim.prefill.default_chunk_size(method)` is
  None and no chunked prefill was asked for); no for block-wise / chunked prefills (KeyDiff's budget
  mode, LagKV chunk-by-chunk), where eviction between blocks changes the later blocks' hidden states:
  those are recomputed.
Methods that need queries (SnapKV, H2O, TOVA, LazyEviction via kvtrim's attention) reuse the prefill
only when the queries were captured, i.e. when the model runs kvtrim's attention function.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvtrim.attention import is_enabled
from kvtrim.cache import TrimCache, TrimLayer, take_pending_layer
from kvtrim.methods.base import EvictionMethod
from kvtrim.methods.full import FullCache
from kvtrim.prefill import default_chunk_size, prefill


def waits_for_attention(method: EvictionMethod) -> bool:
    return bool(method.needs_queries or method.needs_attention)


def reuses_prefill(method: EvictionMethod, chunk_size: int | None = None) -> bool:
    """True when `method`'s selection after a shared one-shot prefill equals its direct path."""
    declared = getattr(type(method), "reusable_prefill", None)
    if declared is not None:
        return bool(declared)
    return chunk_size is None and default_chunk_size(method) is None


class QueryRecorder(FullCache):
    """Keeps everything and records, per layer, the queries and scale that kvtrim's attention hands over."""

    name = "_query_recorder"
    needs_queries = True

    def new_state(self, layer_idx):
        return {}

    def on_attention(self, layer, queries, attention):
        layer.state = {"queries": queries, "scaling": getattr(layer, "attn_scaling", None)}
        return None


@dataclass
class SharedPrefill:
    """A prompt run once into a full cache. `logits`: last prompt token `(1, vocab)`."""

    cache: TrimCache
    logits: torch.Tensor
    has_queries: bool

    def layer_queries(self, idx: int) -> tuple[torch.Tensor | None, float | None]:
        state = self.cache.layers[idx].state if self.has_queries else None
        if not state:
            return None, None
        return state["queries"], state["scaling"]


@torch.no_grad()
def shared_prefill(model, input_ids: torch.Tensor, capture_queries: bool) -> SharedPrefill:
    """Run `input_ids` `(1, n)` once (one forward) into a full cache, recording queries if asked.

    Queries are recorded only when the model runs kvtrim's attention function; `has_queries` says
    whether every evicting layer got them."""
    capture_queries = capture_queries and is_enabled(model)  # only kvtrim's attention hands queries over
    method = QueryRecorder() if capture_queries else FullCache()
    cache = TrimCache(method, config=model.config)
    logits = prefill(model, input_ids, cache, chunk_size=input_ids.shape[-1])
    has = capture_queries and all(
        bool(layer.state) for layer in cache.layers if isinstance(layer, TrimLayer)
    )
    if capture_queries and not has:  # the attention function never answered: leave no waiting layer behind
        for idx, layer in enumerate(cache.layers):
            if isinstance(layer, TrimLayer):
                take_pending_layer(idx)
                layer._awaiting_attention = False
    return SharedPrefill(cache, logits, has)


def replay(shared: SharedPrefill, method: EvictionMethod, config) -> TrimCache:
    """A fresh `TrimCache(method)` fed the shared prompt's keys and values as one forward would feed it."""
    cache = TrimCache(method, config=config)
    for idx, source in enumerate(shared.cache.layers):
        if not isinstance(source, TrimLayer):  # sliding-window layers: method-independent, copy them
            while len(cache.layers) <= idx:
                cache.layers.append(None)
            cache.layers[idx] = copy.deepcopy(source)
            continue
        cache.update(source.keys, source.values, idx)
        layer = cache.layers[idx]
        if layer._awaiting_attention:
            take_pending_layer(idx)
            queries, scaling = shared.layer_queries(idx)
            layer.after_attention(queries, None, scaling)
    return cache
