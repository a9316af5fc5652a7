"""Compress once, ask many: a context prefilled and compressed once, then any number of questions.

    ctx = kvtrim.compress(model, context_ids, kvtrim.SnapKV(compression_ratio=0.5))
    answer = ctx.generate(question_ids, max_new_tokens=32)   # from a copy: ctx is unchanged
    print(ctx.stats())

`compress` feeds the context as the prompt (block-wise when the method is block-wise) and ends the
prompt, so one-shot methods compress right after it with what they have: query-aware methods use the
context's own last queries (as kvpress does), since the question is not known yet. Each question is
then an *append* (`Phase.APPEND`) on a copy of the compressed cache, followed by decoding; methods that
also evict at appends or while decoding do so on that copy.

`CompressedContext.recompress(method)` replays a context prefilled once into a full cache into another
method's cache, without running the model again. It is exact for every method whose prefill is one
forward (see `kvtrim.compress.recompress`); `kvtrim eval` uses it to compare many methods on one prefill.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from kvtrim.attention import is_enabled
from kvtrim.cache import CacheStats, TrimCache, TrimLayer
from kvtrim.decoding import pad_token_id
from kvtrim.methods.base import EvictionMethod, Phase, check
from kvtrim.methods.full import FullCache
from kvtrim.prefill import as_sequences, padded_layout, prefill, prefill_padded


class _QueryRecorder(FullCache):
    """Keeps everything and records, per layer, the queries kvtrim's attention hands over."""

    name = "_query_recorder"
    needs_queries = True

    def new_state(self, layer_idx):
        return {}

    def on_attention(self, view):
        view.state["queries"] = view.queries
        return None


@dataclass
class CompressedContext:
    """A context in a compressed cache, ready for questions.

    Attributes:
        model: the model it was computed with.
        cache: the compressed `TrimCache` (do not feed it directly; `generate` and `new_cache` copy it).
        context_ids: `(batch, n)` the context tokens.
        logits: `(batch, vocab)` logits of the context's last token.
        one_shot_full: True when the context went through one forward into a full cache (then
            `recompress` can replay it for other methods).
        attention_mask: `(batch, n)` for a padded batch of contexts (`context_ids` is then its layout,
            see `kvtrim.prefill.padded_layout`), else None.
    """

    model: object
    cache: TrimCache
    context_ids: torch.Tensor
    logits: torch.Tensor
    one_shot_full: bool = False
    prefill_seconds: float = 0.0  # the context's prefill (its forwards and the selection at the prompt's end)
    scoring_seconds: float = 0.0  # the method's scoring passes (KVzip's reconstruction), if any
    attention_mask: torch.Tensor | None = None

    @property
    def method(self) -> EvictionMethod:
        return self.cache.method

    def stats(self) -> CacheStats:
        return self.cache.stats()

    def new_cache(self) -> TrimCache:
        """A copy of the compressed cache, to continue from (this context stays unchanged)."""
        return self.cache.copy()

    @torch.no_grad()
    def generate(self, question_ids, max_new_tokens: int = 32, cache: TrimCache | None = None,
                 attention_mask: torch.Tensor | None = None, **generate_kwargs) -> torch.Tensor:
        """Answer `question_ids` `(batch, m)`, m >= 1, from a copy of the compressed cache with the stock
        `model.generate` (greedy unless told otherwise). `cache`: continue in this cache instead (e.g.
        `ctx.cache` itself, when no other question will follow). Returns the new ids `(batch, new_len)`.

        After a padded batch of contexts, questions of different lengths: a list of sequences (left-padded
        here), or `(batch, m)` ids with their `attention_mask`; each sequence continues at its own position."""
        check(isinstance(max_new_tokens, int) and max_new_tokens >= 1,
              f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        model = self.model
        if isinstance(question_ids, (list, tuple)) or attention_mask is not None:
            check(self.attention_mask is not None, "questions of different lengths need a padded batch of contexts: "
                                                   "kvtrim.compress(model, [context, ...], method)")
            question_ids, attention_mask = padded_layout(as_sequences(question_ids, attention_mask), None,
                                                         pad_token_id(model) or 0)[:2]
        check(isinstance(question_ids, torch.Tensor) and question_ids.ndim == 2,
              "question_ids must be a (batch, m) tensor of token ids")
        check(question_ids.shape[0] == self.context_ids.shape[0],
              f"question batch {question_ids.shape[0]} != context batch {self.context_ids.shape[0]}")
        check(question_ids.shape[-1] >= 1, "the question must have at least one token")
        ids = torch.cat([self.context_ids, question_ids.to(self.context_ids.device)], dim=-1).to(model.device)
        mask = torch.ones_like(ids)
        if self.attention_mask is not None:
            tail = torch.ones_like(question_ids) if attention_mask is None else attention_mask
            mask = torch.cat([self.attention_mask, tail.to(self.attention_mask.device)], dim=-1).to(model.device)
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", pad_token_id(model))
        out = model.generate(ids, attention_mask=mask, cache=cache if cache is not None else self.new_cache(),
                             max_new_tokens=max_new_tokens, **generate_kwargs)
        return out[:, ids.shape[-1]:]

    def recompress(self, method: EvictionMethod) -> CompressedContext:
        """This context compressed by `method` instead, without running the model again.

        Only for a context prefilled in one forward into a full cache (`compress(..., FullCache(),
        record_queries=...)`), and a method whose own prefill is one forward (no block-wise prefill:
        eviction between blocks would change the later blocks' hidden states). Exact: with a one-shot
        prefill every layer attends to the whole context whatever the method, so keys, values and
        queries are the same; the method only changes what is kept."""
        check(self.one_shot_full, "recompress needs a context prefilled in one forward into a full cache")
        check(self.attention_mask is None, "recompress is not supported for a padded batch of contexts yet")
        check(not method.scoring_passes,
              f"{type(method).__name__} scores the context with its own passes: compress the context with it directly")
        check(method.prefill_block_size() is None,
              f"{type(method).__name__} prefills block by block: compress the context with it directly")
        queries = [layer.state.get("queries") if isinstance(layer.state, dict) else None
                   for layer in self.cache.layers if isinstance(layer, TrimLayer)]
        check(not method.waits_for_attention or all(q is not None for q in queries),
              f"{type(method).__name__} needs the context's queries: compress with record_queries=True "
              "on a model running kvtrim attention")
        cache = replay(self.model, self.cache, method, ends_prompt=True)
        return CompressedContext(self.model, cache, self.context_ids, self.logits)


@torch.no_grad()
def replay(model, source: TrimCache, method: EvictionMethod, ends_prompt: bool) -> TrimCache:
    """`source`'s stored keys and values fed into a new `TrimCache(method)` as one prompt forward.

    The queries recorded in `source` go to layers whose method waits for them; sliding-window layers are
    method-independent and copied. With `ends_prompt` the method compresses now (`recompress`); without,
    the prompt stays open (KVzip's shared scoring in a sweep ends it later).
    """
    cache = TrimCache(method, config=model.config)
    cache.kvtrim_attention = is_enabled(model)
    with cache.phase(Phase.PREFILL, ends_prompt=ends_prompt):
        for idx, layer_in in enumerate(source.layers):
            if not isinstance(layer_in, TrimLayer):  # sliding-window layers: method-independent, copy them
                while len(cache.layers) <= idx:
                    cache.layers.append(None)
                cache.layers[idx] = copy.deepcopy(layer_in)
                continue
            cache.update(layer_in.keys, layer_in.values, idx)
            layer = cache.layers[idx]
            if layer.awaiting_attention:
                queries = layer_in.state.get("queries") if isinstance(layer_in.state, dict) else None
                layer.after_attention(queries, None, layer_in.attn_scaling)
    return cache


def compress(
    model,
    context_ids,
    method: EvictionMethod,
    chunk_size: int | None | str = "auto",
    record_queries: bool = False,
    tokenizer=None,
    attention_mask: torch.Tensor | None = None,
) -> CompressedContext:
    """Prefill `context_ids` `(batch, n)` into a `TrimCache(method)` and end the prompt (compressing it).

    A padded batch: `context_ids` a list of sequences (1-D tensors or lists of ids), or `(batch, n)` ids
    with an `attention_mask` that has pads (either side). Each context is then compressed as it would be
    alone (its own blocks when block-wise: `kvtrim.prefill.padded_layout`; its own budget); the model must
    run kvtrim's attention. Not for methods with scoring passes (KVzip) or cross-layer decisions yet.

    Methods with scoring passes (KVzip) then run them (`Phase.SCORE`: forwards that attend to the cache
    and store nothing) before the prompt ends; they need the model's `tokenizer` to build their inputs.
    `ctx.prefill_seconds` (the context's forwards and the method's selection at the end of the prompt) and
    `ctx.scoring_seconds` (the scoring passes, `run_scoring_passes`) time the two parts.

    Args:
        chunk_size: tokens per forward; "auto" = the method's block size (block-wise methods such as
            KeyDiff(budget=)), else one forward; None = one forward.
        record_queries: with a full cache (`FullCache()`) and one forward, keep every layer's queries so
            that `recompress` can serve methods that need them (the model must run kvtrim attention).
    """
    check(isinstance(method, EvictionMethod), f"compress needs an eviction method, got {type(method).__name__}")
    if chunk_size == "auto":
        chunk_size = method.prefill_block_size()
    if isinstance(context_ids, (list, tuple)) or (attention_mask is not None and not bool(attention_mask.all())):
        return _compress_padded(model, as_sequences(context_ids, attention_mask), method, chunk_size, record_queries)
    check(isinstance(context_ids, torch.Tensor) and context_ids.ndim == 2 and context_ids.shape[-1] >= 1,
          "context_ids must be a (batch, n) tensor of token ids with n >= 1")
    one_shot_full = type(method) is FullCache and (chunk_size is None or chunk_size >= context_ids.shape[-1])
    if record_queries:
        check(type(method) is FullCache, "record_queries=True is for a full cache (FullCache())")
        check(is_enabled(model), "record_queries=True needs kvtrim attention: call kvtrim.enable(model)")
        method = _QueryRecorder()
    passes = method.scoring_inputs(context_ids, tokenizer) if method.scoring_passes else []
    check(not method.waits_for_attention or is_enabled(model),
          f"{type(method).__name__} needs kvtrim's attention function: call kvtrim.enable(model)")
    cache = TrimCache(method, config=model.config)
    start = time.perf_counter()
    logits = prefill(model, context_ids, cache, chunk_size=chunk_size, end_prompt=not passes)
    prefill_seconds = time.perf_counter() - start
    scoring_seconds = run_scoring_passes(model, cache, passes)
    if passes:
        start = time.perf_counter()
        cache.end_prompt()  # the selection: part of the prefill, as for every method
        prefill_seconds += time.perf_counter() - start
    return CompressedContext(model, cache, context_ids, logits, one_shot_full, prefill_seconds, scoring_seconds)


def _compress_padded(model, sequences: list[torch.Tensor], method: EvictionMethod, chunk_size: int | None,
                     record_queries: bool) -> CompressedContext:
    """`compress` of a padded batch (see there)."""
    name = type(method).__name__
    check(not method.scoring_passes, f"{name} scores the context with its own passes, which is not supported on a "
                                     "padded batch yet: compress each context alone")
    check(not record_queries, "record_queries=True is not supported for a padded batch of contexts yet")
    ids, mask, widths = padded_layout(sequences, chunk_size, pad_token_id(model) or 0)
    cache = TrimCache(method, config=model.config, padded=True)
    start = time.perf_counter()
    logits = prefill_padded(model, ids, mask, widths, cache)
    ids, mask = ids.to(model.device), mask.to(model.device)
    return CompressedContext(model, cache, ids, logits, False, time.perf_counter() - start, 0.0, mask)


@torch.no_grad()
def run_scoring_passes(model, cache: TrimCache, passes: list[tuple[torch.Tensor, object]]) -> float:
    """Run a method's scoring passes on `cache`, prefilled with the prompt still open; returns their
    wall time in seconds (synchronised on CUDA). The one place that runs them: `compress` and
    `kvtrim bench` both call it, for any method with `scoring_passes` (`method.scoring_inputs`).

    Each pass `(input_ids (batch, r), info)` is one forward in `Phase.SCORE` at positions continuing
    after the cache: it attends to every stored entry and stores nothing. The prompt stays open: the
    caller ends it (the method's selection) afterwards."""
    if not passes:
        return 0.0
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for input_ids, info in passes:
        seen = cache.get_seq_length()
        positions = torch.arange(seen, seen + input_ids.shape[-1], device=device).expand(input_ids.shape[0], -1)
        with cache.phase(Phase.SCORE, info=info):
            model(input_ids=input_ids.to(device), cache=cache, position_ids=positions, use_cache=True,
                  logits_to_keep=1)
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
