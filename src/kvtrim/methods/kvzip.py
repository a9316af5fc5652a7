"""KVzip (Kim et al., arXiv 2505.23416, NeurIPS 2025): pure functions and the `KVzip` method.

KVzip scores every cached context entry by the attention it receives while the model *reconstructs the
context from the cache*: after the prefill, a "repeat the previous context" prompt, the chat turn
separator and the context tokens themselves are fed (teacher-forced, chunk by chunk) on top of the
cache; an entry's score is the largest softmax weight any reconstruction query of its GQA group gives
it. The lowest-scoring entries are evicted under one threshold shared by all layers and KV heads, so
budgets differ per layer and per head. The reconstruction tokens' own KV entries are never kept: the
cache is cut back to the context after each reconstruction forward.

This module holds the three steps as pure functions; `docs/kvzip.md` compares the paper, the official
code (snu-mllab/KVzip) and kvpress 0.5.5's `KVzipPress` line by line.

1. Reconstruction inputs: `reconstruction_chunks(context_ids, pieces, ...)` splits the context into
   chunks of `chunk_size` tokens (official 2000, kvpress 2048) and builds, per chunk,
   `[prompt][separator][chunk]`: the first chunk's prompt is "Repeat the previous context exactly.",
   later chunks' prompt is "Repeat the part of the previous context exactly, starting with" followed
   by the last 8 tokens of the previous chunk. `reconstruction_pieces(tokenizer, mode, style)` tokenizes
   the prompts and the separator ("chat": the text a chat template puts after a user turn, as kvpress
   derives it; "raw": a newline, kvpress's choice for tokenizers without a chat template);
   `chat_context(tokenizer, text)` formats a context as kvpress's pipeline does and returns the
   length of the chat head before it.
2. Scoring: `reconstruction_scores(queries, context_keys, own_keys, start, stop, sink_size, scores)`,
   for one layer and one chunk forward; `scores` accumulates by a running maximum over chunks.
3. Selection: `select_global(...)` (one threshold over all layers and heads, or per layer with
   `layerwise=True`; ragged, a keep mask per layer) and `select_uniform(...)` (the same count in every
   head of a layer: kept indices for today's rectangular cache).

Choices and deviations (all documented in `docs/kvzip.md`):
* Softmax and scores in float32 (both implementations use the model dtype, bf16 in the paper's runs,
  where many scores tie); scaling `1/sqrt(head_dim)` as both do (not the model's own `scaling`, which
  differs for Gemma-style `query_pre_attn_scalar`).
* Ties go to the earlier entry, everywhere: in the global pool the order is (layer, head, position).
  The official code keeps the entries *strictly above* the score at sorted index `int(N*keep)-1`, so it
  keeps `int(N*keep)-1` entries and drops every entry tied with that threshold; kvpress takes
  `torch.topk`'s arbitrary choice among ties. We reproduce the official *count*, not its tie dropping.
* `rounding="official"` (default) or `"kvpress"` says how `compression_ratio` becomes a kept count
  (see `kept_in_pool`); `budget=` (entries kept per KV head per layer, on average for the ragged
  modes, protected entries included) is exact.
* Protected entries (`protected`, the leading entries of every head: the system prompt in the
  official code, the first 4 entries in kvpress) are always kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kvtrim.methods.base import EvictionMethod, Phase, check, check_compression_ratio, top_indices

#: prompt of the first chunk (official model/wrapper.py and kvpress alike)
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
#: prompt of later chunks, followed by the last `CONTINUATION_TOKENS` tokens of the previous chunk;
#: the official text ends with a space, kvpress's does not
LATER_PROMPT = {
    "official": "\n\nRepeat the part of the previous context exactly, starting with ",
    "kvpress": "\n\nRepeat the part of the previous context exactly, starting with",
}
OFFICIAL_CHUNK_SIZE = 2000
KVPRESS_CHUNK_SIZE = 2048
CONTINUATION_TOKENS = 8
#: separator after the prompt when there is no chat template (kvpress's default for such tokenizers)
RAW_SEPARATOR = "\n"
ROUNDINGS = ("official", "kvpress")


# ---- 1. reconstruction inputs ---------------------------------------------------------------------
@dataclass(frozen=True)
class ReconstructionPieces:
    """Token ids of the fixed parts of a reconstruction input: `[prompt][separator][chunk]`."""

    first_prompt: tuple[int, ...]
    later_prompt: tuple[int, ...]
    separator: tuple[int, ...]

    def __post_init__(self):
        for name in ("first_prompt", "later_prompt", "separator"):
            value = getattr(self, name)
            check(isinstance(value, tuple) and all(isinstance(t, int) for t in value),
                  f"ReconstructionPieces.{name} must be a tuple of token ids")


@dataclass(frozen=True)
class ReconstructionChunk:
    """One reconstruction forward: `input_ids` `(batch, r)` reconstructs cache entries `[start, stop)`."""

    start: int
    stop: int
    input_ids: torch.Tensor


def reconstruction_chunks(
    context_ids: torch.Tensor,
    pieces: ReconstructionPieces,
    *,
    offset: int = 0,
    chunk_size: int = OFFICIAL_CHUNK_SIZE,
    continuation: int = CONTINUATION_TOKENS,
) -> list[ReconstructionChunk]:
    """The reconstruction inputs of a context, one per chunk, as the official code and kvpress build them.

    Args:
        context_ids: `(batch, n_ctx)` the tokens to reconstruct; they sit in the cache at entries
            `[offset, offset + n_ctx)` (`offset` = the chat head / system prompt before them).
        chunk_size: tokens per chunk; consecutive, non-overlapping, the last one shorter.
        continuation: later chunks' prompt ends with the previous chunk's last `continuation` tokens.
    Returns:
        Chunk `i` has `input_ids = [prompt_i][separator][context chunk i]` with `prompt_0 = first_prompt`
        and `prompt_i = later_prompt + previous chunk[-continuation:]`, and `[start, stop)` its entries
        in the cache.
    """
    check(isinstance(context_ids, torch.Tensor) and context_ids.dim() == 2,
          "context_ids must be a (batch, n) tensor of token ids")
    check(isinstance(pieces, ReconstructionPieces), "pieces must be a ReconstructionPieces")
    check(isinstance(chunk_size, int) and chunk_size > 0, f"chunk_size must be a positive int, got {chunk_size!r}")
    check(isinstance(continuation, int) and continuation >= 0,
          f"continuation must be a non-negative int, got {continuation!r}")
    check(isinstance(offset, int) and offset >= 0, f"offset must be a non-negative int, got {offset!r}")
    b, n = context_ids.shape
    check(n > 0, "the context to reconstruct is empty")

    def ids(tokens: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=context_ids.dtype, device=context_ids.device).expand(b, len(tokens))

    chunks: list[ReconstructionChunk] = []
    for i, lo in enumerate(range(0, n, chunk_size)):
        hi = min(lo + chunk_size, n)
        if i == 0:
            prompt = ids(pieces.first_prompt)
        else:  # the previous chunk's tail tells the model where to resume
            tail = context_ids[:, max(lo - chunk_size, lo - continuation):lo]
            prompt = torch.cat([ids(pieces.later_prompt), tail], dim=1)
        inputs = torch.cat([prompt, ids(pieces.separator), context_ids[:, lo:hi]], dim=1)
        chunks.append(ReconstructionChunk(offset + lo, offset + hi, inputs))
    return chunks


def _encode(tokenizer: Any, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))


def _chat_split(tokenizer: Any, content: str, marker: str) -> tuple[str, str]:
    """Render a one-user-turn chat with `content + marker` and split it at `marker`: (before, after)."""
    check(getattr(tokenizer, "chat_template", None) is not None,
          "chat mode needs a tokenizer with a chat template (use mode='raw' for base models)")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content + marker}], add_generation_prompt=True, tokenize=False,
        enable_thinking=False,
    )
    check(rendered.count(marker) == 1, "could not locate the user turn in the chat template's output")
    before, after = rendered.split(marker)
    return before, after


def reconstruction_pieces(tokenizer: Any, mode: str = "chat", style: str = "official") -> ReconstructionPieces:
    """Tokenize the reconstruction prompts and separator with a Hugging Face tokenizer.

    Args:
        mode: "chat": the separator is what the chat template puts after a user turn (end of turn +
            assistant header, e.g. `<|im_end|>\\n<|im_start|>assistant\\n`), derived as kvpress does;
            "raw": a newline (kvpress's choice for tokenizers without a chat template), for base models
            and plain documents. "raw" is our named option, to be measured; the paper only uses chat.
        style: "official" or "kvpress": the later-chunk prompt with or without its trailing space.
    """
    check(mode in ("chat", "raw"), f"mode must be 'chat' or 'raw', got {mode!r}")
    check(style in LATER_PROMPT, f"style must be one of {sorted(LATER_PROMPT)}, got {style!r}")
    if mode == "chat":
        _, separator = _chat_split(tokenizer, "dummy context", "\n" + "#" * len("dummy context"))
    else:
        separator = RAW_SEPARATOR
    return ReconstructionPieces(_encode(tokenizer, FIRST_PROMPT), _encode(tokenizer, LATER_PROMPT[style]),
                                _encode(tokenizer, separator))


def chat_context(tokenizer: Any, text: str) -> tuple[torch.Tensor, int]:
    """A context formatted as kvpress's pipeline does: the chat head, then `text` (the user turn left open,
    the question and the turn end come later). Returns `(ids (1, n), prefix_length)` where
    `prefix_length` is the length of the chat head, computed as `KVzipPress` does (by tokenizing the
    head alone); the context proper is `ids[:, prefix_length:]`."""
    check(isinstance(text, str) and text != "", "the context must be a non-empty string")
    before, _ = _chat_split(tokenizer, text, "#" * (len(text) + 10))
    head, _ = _chat_split(tokenizer, "dummy context", "\n" + "#" * len("dummy context"))
    head = head.split("dummy context")[0]
    check(before.startswith(head), "the chat head differs between contexts: cannot locate the context")
    ids = torch.tensor([_encode(tokenizer, before)])
    return ids, len(_encode(tokenizer, head))


# ---- 2. scoring ------------------------------------------------------------------------------------
def reconstruction_scores(
    queries: torch.Tensor,
    context_keys: torch.Tensor,
    own_keys: torch.Tensor,
    start: int,
    stop: int,
    sink_size: int,
    scores: torch.Tensor | None = None,
    scaling: float | None = None,
) -> torch.Tensor:
    """KVzip scores of one layer after one reconstruction forward, folded into `scores` by a running max.

    Each reconstruction query attends, for scoring only, to a subset of keys: the first
    `min(sink_size, start)` cache entries (sinks), the chunk's entries `[start, stop)` and the
    reconstruction tokens' own keys (causally: query `i` sees own keys `0..i`). Softmax over that subset
    (float32, logits scaled by `scaling`, default `1/sqrt(head_dim)`); an entry of the chunk scores the
    maximum weight it gets over the queries and over the query heads of its GQA group. Entries outside
    the chunk are unchanged (entries never scored stay at 0, as in kvpress).

    Args:
        queries: `(batch, q_heads, r, head_dim)` post-RoPE queries of the reconstruction forward.
        context_keys: `(batch, kv_heads, n, head_dim)` the cached context (without the reconstruction).
        own_keys: `(batch, kv_heads, r, head_dim)` the reconstruction tokens' own post-RoPE keys.
        start, stop: the chunk's entries in the cache.
        sink_size: leading entries every query also attends to when scoring (official: the whole
            system prompt; kvpress: 4).
        scores: `(batch, kv_heads, n)` scores so far (None: zeros).
    Returns:
        `(batch, kv_heads, n)` float32: `scores` with `[start, stop)` replaced by the running maximum.
    Peak extra memory: one KV head's `(batch, group, r, sinks + chunk + r)` float32 logits.
    """
    check(all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (queries, context_keys, own_keys)),
          "queries, context_keys and own_keys must be 4-D tensors (batch, heads, seq, head_dim)")
    b, hq, r, d = queries.shape
    _, hkv, n, dk = context_keys.shape
    check(context_keys.shape[0] == b and own_keys.shape[0] == b, "queries and keys differ in batch size")
    check(dk == d and own_keys.shape[-1] == d, "queries and keys differ in head_dim")
    check(own_keys.shape[1] == hkv, "context_keys and own_keys differ in kv_heads")
    check(hq % hkv == 0, f"q_heads ({hq}) must be a multiple of kv_heads ({hkv})")
    check(own_keys.shape[2] == r, f"own_keys has {own_keys.shape[2]} entries for {r} reconstruction queries")
    check(isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= n,
          f"chunk [{start}, {stop}) must be a non-empty span of the {n} cached entries")
    check(isinstance(sink_size, int) and sink_size >= 0, f"sink_size must be a non-negative int, got {sink_size!r}")
    if scores is None:
        scores = torch.zeros(b, hkv, n, dtype=torch.float32, device=context_keys.device)
    check(isinstance(scores, torch.Tensor) and tuple(scores.shape) == (b, hkv, n),
          f"scores must be shaped {(b, hkv, n)}, got {tuple(getattr(scores, 'shape', ()))}")
    scale = d ** -0.5 if scaling is None else float(scaling)
    sinks = min(sink_size, start)
    c = stop - start
    group = hq // hkv
    # own keys: query i sees own keys 0..i (the official additive finfo.min mask zeroes the same weights)
    blocked = torch.ones(r, r, dtype=torch.bool, device=queries.device).triu(1)
    out = scores.to(torch.float32).clone()
    for h in range(hkv):  # one KV head at a time bounds the logits' memory
        keys = torch.cat([context_keys[:, h, :sinks], context_keys[:, h, start:stop], own_keys[:, h]], dim=1)
        q = queries[:, h * group:(h + 1) * group].to(torch.float32)  # (b, group, r, d)
        logits = torch.matmul(q, keys.to(torch.float32).transpose(-1, -2).unsqueeze(1)) * scale
        logits[..., sinks + c:] = logits[..., sinks + c:].masked_fill(blocked, float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., sinks:sinks + c]  # (b, group, r, c)
        best = probs.amax(dim=(1, 2))  # max over the group's query heads and over the queries
        out[:, h, start:stop] = torch.maximum(out[:, h, start:stop], best)
    return out


# ---- 3. selection ----------------------------------------------------------------------------------
def kept_in_pool(n_pool: int, n_all: int, n_protected: int, compression_ratio: float, rounding: str,
                 threshold: bool) -> int:
    """How many unprotected entries a pool keeps at `compression_ratio`.

    `n_pool` unprotected entries, `n_all = n_pool + n_protected` entries in all.
    * "official" (snu-mllab/KVzip attention/score.py): keep ratio `r = 1 - compression_ratio` applies to
      the unprotected entries only (the system prompt is outside the scored range). The global
      threshold (`threshold=True`) keeps the entries strictly above the score at descending index
      `max(int(n_pool * r) - 1, 0)`: `max(int(n_pool * r) - 1, 0)` entries without ties (all of them
      at `compression_ratio=0`, where it skips the threshold). The
      uniform per-head variant (`threshold=False`, official level "pair-uniform") keeps
      `int(n_pool * r)` with `topk`.
    * "kvpress" (KVzipPress.compress_post): evict `int(n_all * compression_ratio)` entries counted over
      all entries, protected ones included (they are never evicted): keep `n_all - int(...)` in all.
    """
    if rounding == "official":
        if compression_ratio == 0:  # the official code skips thresholding at keep ratio 1
            return n_pool
        k = int(n_pool * (1 - compression_ratio))
        return max(k - 1, 0) if threshold else k
    return max(min(n_all - int(n_all * compression_ratio) - n_protected, n_pool), 0)


def _check_scores(scores: Sequence[torch.Tensor]) -> tuple[int, int]:
    check(isinstance(scores, (list, tuple)) and len(scores) > 0, "scores must be a non-empty list, one per layer")
    check(all(isinstance(s, torch.Tensor) and s.dim() == 3 for s in scores),
          "each layer's scores must be a (batch, kv_heads, n) tensor")
    b, h = scores[0].shape[:2]
    check(all(tuple(s.shape[:2]) == (b, h) for s in scores), "layers' scores differ in batch size or kv_heads")
    return b, h


def _check_amount(compression_ratio: float | None, budget: int | None, rounding: str, protected: int) -> None:
    check((compression_ratio is None) != (budget is None), "give exactly one of compression_ratio= and budget=")
    if compression_ratio is not None:
        check(isinstance(compression_ratio, (int, float)) and not isinstance(compression_ratio, bool),
              f"compression_ratio must be a number, got {compression_ratio!r}")
        check_compression_ratio(compression_ratio)
    else:
        check(isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1,
              f"budget must be a positive int, got {budget!r}")
        check(budget >= protected, f"budget ({budget}) is smaller than the protected entries ({protected})")
    check(rounding in ROUNDINGS, f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    check(isinstance(protected, int) and not isinstance(protected, bool) and protected >= 0,
          f"protected must be a non-negative int, got {protected!r}")


def _pool_keep(flat: torch.Tensor, pool: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask `(batch, N)`: the `k` highest `flat` among `pool` entries (ties -> earlier)."""
    masked = flat.masked_fill(~pool, float("-inf"))
    keep = torch.zeros_like(pool)
    k = min(k, int(pool[0].sum()))
    if k > 0:
        keep.scatter_(1, top_indices(masked, k), True)
    return keep


def select_global(
    scores: Sequence[torch.Tensor],
    *,
    compression_ratio: float | None = None,
    budget: int | None = None,
    protected: int = 0,
    layerwise: bool = False,
    rounding: str = "official",
) -> list[torch.Tensor]:
    """KVzip's allocation: evict the lowest scores under one threshold over all layers and KV heads
    (`layerwise=True`: one threshold per layer, the same kept fraction in every layer, as kvpress's
    option), so heads keep different numbers of entries.

    Args:
        scores: per layer `(batch, kv_heads, n_l)` (layers may differ in `n_l`); each batch row is
            selected on its own.
        compression_ratio: fraction removed, turned into a count by `rounding` (see `kept_in_pool`).
        budget: entries kept per KV head per layer on average (protected included): the pool keeps
            `budget * kv_heads * layers` entries in all (`* kv_heads` per layer when `layerwise`).
        protected: the first `protected` entries of every head and layer are always kept.
    Returns:
        Per layer a boolean keep mask `(batch, kv_heads, n_l)`. Ties go to the earlier entry in
        (layer, head, position) order.
    """
    b, h = _check_scores(scores)
    _check_amount(compression_ratio, budget, rounding, protected)
    check(isinstance(layerwise, bool), f"layerwise must be True or False, got {layerwise!r}")
    sizes = [s.shape[-1] for s in scores]
    groups = [[i] for i in range(len(scores))] if layerwise else [list(range(len(scores)))]
    masks: list[torch.Tensor | None] = [None] * len(scores)
    for layers in groups:
        flat = torch.cat([scores[i].to(torch.float32).reshape(b, -1) for i in layers], dim=1)
        pool = torch.cat([
            (torch.arange(sizes[i], device=flat.device) >= protected).expand(b, h, sizes[i]).reshape(b, -1)
            for i in layers], dim=1)
        n_pool = int(pool[0].sum())
        n_protected = flat.shape[1] - n_pool
        if budget is not None:
            k = budget * h * len(layers) - n_protected
        else:
            k = kept_in_pool(n_pool, flat.shape[1], n_protected, compression_ratio, rounding, threshold=True)
        keep = _pool_keep(flat, pool, k) | ~pool
        for i, part in zip(layers, keep.split([h * sizes[i] for i in layers], dim=1)):
            masks[i] = part.reshape(b, h, sizes[i])
    return masks


def select_uniform(
    scores: Sequence[torch.Tensor],
    *,
    compression_ratio: float | None = None,
    budget: int | None = None,
    protected: int = 0,
    rounding: str = "official",
) -> list[torch.Tensor]:
    """KVzip scores with the same kept count in every head of a layer (official level "pair-uniform"),
    for a rectangular cache: per layer and head, the protected entries plus the top of the rest.

    Args: as `select_global` (`budget` = entries kept per head, protected included).
    Returns:
        Per layer the kept indices `(batch, kv_heads, k_l)`, sorted ascending (ties -> earlier entry).
    """
    _check_scores(scores)
    _check_amount(compression_ratio, budget, rounding, protected)
    kept = []
    for s in scores:
        n = s.shape[-1]
        p = min(protected, n)
        if budget is not None:
            k = budget - p
        else:
            k = kept_in_pool(n - p, n, p, compression_ratio, rounding, threshold=False)
        k = max(min(k, n - p), 0)
        head = torch.arange(p, device=s.device).expand(*s.shape[:2], p)
        tail = top_indices(s[..., p:].to(torch.float32), k) + p if k > 0 else head[..., :0]
        kept.append(torch.cat([head, tail], dim=-1))
    return kept


def mask_to_indices(mask: torch.Tensor) -> list[list[torch.Tensor]]:
    """A keep mask `(batch, kv_heads, n)` as kept positions per (batch, head), ascending."""
    check(isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.dtype == torch.bool,
          "mask must be a boolean (batch, kv_heads, n) tensor")
    return [[row.nonzero().flatten() for row in batch] for batch in mask]


__all__ = [
    "CONTINUATION_TOKENS", "FIRST_PROMPT", "KVPRESS_CHUNK_SIZE", "LATER_PROMPT", "OFFICIAL_CHUNK_SIZE",
    "RAW_SEPARATOR", "ROUNDINGS", "ReconstructionChunk", "ReconstructionPieces", "chat_context",
    "kept_in_pool", "mask_to_indices", "reconstruction_chunks", "reconstruction_pieces",
    "reconstruction_scores", "select_global", "select_uniform", "KVzip", "chat_head_length",
]


# ---- the method -----------------------------------------------------------------------------------
def chat_head_length(tokenizer: Any, context_ids: torch.Tensor) -> int:
    """Length of the chat head (the template's text before a user message) at the start of
    `context_ids` `(batch, n)`, tokenized alone as `KVzipPress` does; 0 when the context does not start
    with it (raw prompts, base models without a chat template)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return 0
    head, _ = _chat_split(tokenizer, "dummy context", "\n" + "#" * len("dummy context"))
    head_ids = _encode(tokenizer, head.split("dummy context")[0])
    n = len(head_ids)
    if n == 0 or context_ids.shape[-1] <= n:
        return 0
    return n if context_ids[0, :n].tolist() == list(head_ids) else 0


VARIANTS = ("official", "kvpress")
LEVELS = ("uniform", "head")


@dataclass
class _KVzipState:
    scores: torch.Tensor | None = None  # (batch, kv_heads, n) running max over the reconstruction passes
    protected: int = 0


@dataclass(kw_only=True)
class KVzip(EvictionMethod):
    """KVzip: query-agnostic compression by context reconstruction (Kim et al., arXiv 2505.23416).

    After the context is prefilled, `kvtrim.compress(model, ids, KVzip(...), tokenizer=tok)` feeds the
    reconstruction inputs (`scoring_inputs`: "Repeat the previous context exactly." + the chat separator +
    the context, chunk by chunk) as scoring passes (`Phase.SCORE`: they attend to the cache and store
    nothing); every context entry scores the largest attention any reconstruction query of its GQA group
    gives it (`reconstruction_scores`); then the lowest entries are evicted (`select_layers`).

    Exactly one size: `compression_ratio=` (fraction of the context removed) or `budget=` (entries kept
    per KV head and layer, protected entries included).

    Args:
        variant: "official" (snu-mllab/KVzip, default): chunks of 2000, the whole chat head is softmax
            sinks and protected (4 sinks when the context has no chat head), the official kept count;
            "kvpress" (KVzipPress 0.5.5): chunks of 2048, 4 sinks protected inside the budget, the rest of
            the chat head unscored (evicted first), kvpress's count — its kept sets are reproduced exactly.
        chunk_size: reconstruction chunk (None: the variant's).
        level: "head" (default): one threshold over all heads and layers (the paper's allocation, the
            official code's default level "pair" and kvpress's): heads keep different counts, the cache
            stores those layers ragged and frees the evicted entries' memory (kvpress only masks them);
            "uniform": the same number of entries in every head and layer (the official "pair-uniform"
            level; every layer stays a dense rectangle, the fast path). The default was "uniform" until
            the ranking run (`benchmarks/qwen_rank/`, 25 samples per cell) measured "head" at 79.8 and
            76.1 against 52.8 and 27.4 (average over 9 tasks, compression 0.5 / 0.75): rows labelled
            plain `kvzip` committed before 2026-12-05 ran "uniform" (their `method_config` says so).
        layerwise: with level "head", one threshold per layer (kvpress's option).
        prompt_format: "chat": the separator is the chat template's end of turn + assistant header (as
            kvpress derives it); "raw": a newline (for base models and plain documents; a kvtrim option).

    Deviations (see `docs/kvzip.md`): float32 scores; ties go to the earlier entry (the official code
    drops every entry tied with its threshold, kvpress breaks ties arbitrarily); the official variant
    falls back to 4 sinks without a chat head (the official code assumes a system prompt).
    Peak memory while scoring: the cache plus one chunk's reconstruction entries (transient) and one KV
    head's `(group, r, sinks + chunk + r)` float32 logits.
    """

    name = "kvzip"
    summary = "context-reconstruction attention, query-agnostic, via kvtrim.compress (KVzip); needs kvtrim attention"
    needs_queries = True
    scoring_passes = True
    cross_layer = True
    size_params = ("compression_ratio", "budget")

    compression_ratio: float | None = None
    budget: int | None = None
    variant: str = "official"
    chunk_size: int | None = None
    level: str = "head"
    layerwise: bool = False
    prompt_format: str = "chat"

    def __post_init__(self):
        super().__post_init__()
        check((self.compression_ratio is None) != (self.budget is None),
              "KVzip needs exactly one of budget= or compression_ratio=")
        if self.compression_ratio is not None:
            check_compression_ratio(self.compression_ratio)
        else:
            check(self.budget >= 1, f"budget must be >= 1, got {self.budget}")
        check(self.variant in VARIANTS, f"variant must be one of {', '.join(VARIANTS)}, got '{self.variant}'")
        check(self.level in LEVELS, f"level must be one of {', '.join(LEVELS)}, got '{self.level}'")
        check(self.level == "head" or not self.layerwise, "layerwise=True needs level='head'")
        check(self.chunk_size is None or self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        check(self.prompt_format in ("chat", "raw"), f"prompt_format must be 'chat' or 'raw', got '{self.prompt_format}'")

    def new_state(self, layer_idx):
        return _KVzipState()

    def scoring_inputs(self, context_ids, tokenizer):
        check(tokenizer is not None, "KVzip builds its reconstruction prompt with the model's tokenizer: "
                                     "kvtrim.compress(model, ids, KVzip(...), tokenizer=tok)")
        pieces = reconstruction_pieces(tokenizer, mode=self.prompt_format, style=self.variant)
        head = chat_head_length(tokenizer, context_ids) if self.prompt_format == "chat" else 0
        check(head < context_ids.shape[-1], "the context holds nothing after its chat head")
        if self.variant == "official":
            sinks = protected = head if head else 4
        else:
            sinks = protected = 4
        size = self.chunk_size or (OFFICIAL_CHUNK_SIZE if self.variant == "official" else KVPRESS_CHUNK_SIZE)
        chunks = reconstruction_chunks(context_ids[:, head:], pieces, offset=head, chunk_size=size)
        return [(c.input_ids, (c.start, c.stop, sinks, protected)) for c in chunks]

    def on_attention(self, view):
        if view.phase is not Phase.SCORE:
            return None
        start, stop, sinks, protected = view.pass_info
        r = view.n_new
        queries = view.require_queries("KVzip")
        state: _KVzipState = view.state
        state.scores = reconstruction_scores(queries, view.keys[:, :, :-r], view.keys[:, :, -r:], start, stop, sinks,
                                             state.scores, scaling=None)
        state.protected = protected
        return None

    def select_layers(self, views):
        n = views[0].stored
        if (self.budget is not None and self.budget >= n) or self.compression_ratio == 0:
            return [None] * len(views)  # nothing to evict
        check(all(v.state.scores is not None for v in views),
              "KVzip scores the context with reconstruction passes: compress it with "
              "kvtrim.compress(model, ids, KVzip(...), tokenizer=tok) (stock generate cannot run them)")
        scores = [v.state.scores for v in views]
        if self.level == "head":  # per-head counts: the cache stores such layers ragged (memory freed)
            return select_global(scores, compression_ratio=self.compression_ratio, budget=self.budget,
                                 protected=views[0].state.protected, layerwise=self.layerwise,
                                 rounding=self.variant)
        return select_uniform(scores, compression_ratio=self.compression_ratio, budget=self.budget,
                              protected=views[0].state.protected, rounding=self.variant)

    def gather_state(self, state, keep):
        state.scores = None  # scores serve one compression
        return state
