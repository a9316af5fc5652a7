"""LagKV (Liang et al., arXiv 2504.04704): attention-free eviction by lag-relative statistics.

The cache of each layer and KV head is cut, after `sink_size` sinks, into partitions of `lag_size`
entries on a fixed grid. Each partition is scored against the *next* one: the next partition's
per-channel min and max normalise the current keys (and values), the spread (std over channels) of
each normalised token is turned into a distribution by a softmax over the partition, and
`score = softmax_K + value_weight * softmax_V`. Each partition keeps its `floor(keep_ratio * lag_size)`
best tokens; the sinks and the last full partition plus the remainder (the window, which has no
successor yet) are kept whole. A compressed partition is never scored again.

Reference mode (`keep_ratio=`) follows the official `LagKV(DynamicCache)`: compression happens inside
the cache update whenever the uncompressed window reaches `2 * lag_size` — during prefill (all
complete partitions at once) and again every `lag_size` decoded tokens. Because the grid is anchored
after the sinks, the same entries are selected whether tokens arrive in one forward, in chunks or one
by one (for the same keys and values).

Global-budget mode (`compression_ratio=`) follows kvpress's `LagKVPress`, which the paper used for its
RULER tables: once, when the prompt ends, partition tokens get their rank within the partition divided
by `lag_size`, sinks and window get an always-keep score, and one top-k per head keeps
`kept_count(n, compression_ratio)` entries — so the per-partition share adapts to the target ratio.
`budget=` gives the same mode an absolute size. Appends and decode steps are kept.

Deviations (documented, all harmless where the reference is well defined):
* scoring runs in float32 and the min-max range is clamped to at least `eps` (the official code
  divides by zero on a constant channel and then ranks NaNs);
* kept indices are sorted by position (the official code keeps them in score order; attention is
  unaffected);
* global mode: inputs shorter than `sink_size + 2 * lag_size` are not compressed (kvpress falls back to
  a StreamingLLM-like ramp there); ties at the budget boundary go to the earlier entry (kvpress breaks
  them arbitrarily, and can drop sinks at extreme ratios; here sinks and window win ties).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtrim.methods.base import ScoringMethod, check, check_compression_ratio, kept_count, span, top_indices


# ---- pure tensor functions ----------------------------------------------------------------------
def _channel_std_(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std over the last dim (what `torch.std` computes), written out as two passes, consuming
    `x` (it is overwritten). On CPU `torch.std` over a short last dim (head_dim 64) is about 10x slower
    than this (torch 2.13); working in place saves three large temporaries, same bits."""
    centered = x.sub_(x.mean(dim=-1, keepdim=True))
    return centered.square_().sum(dim=-1).div_(x.shape[-1] - 1).sqrt_()


def lag_relative_scores(
    keys: torch.Tensor,
    values: torch.Tensor,
    lag_size: int,
    value_weight: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Scores of the first `m` of `m + 1` consecutive partitions, each against its successor.

    Args:
        keys, values: `(batch, kv_heads, (m + 1) * lag_size, head_dim)`.
    Returns:
        `(batch, kv_heads, m, lag_size)` float32 scores (higher = keep).

    One temporary of the inputs' size per component, overwritten in place (normalise, centre, square):
    on CPU the fresh temporaries and their page faults cost more than the arithmetic (about 3x
    faster than out-of-place, the same bits).
    """
    b, h, n, d = keys.shape
    parts = n // lag_size

    def component(x: torch.Tensor) -> torch.Tensor:
        x = (x if x.dtype == torch.float32 else x.float()).view(b, h, parts, lag_size, -1)
        ref = x[:, :, 1:]
        lo = ref.amin(dim=-2, keepdim=True)
        span_ = ref.amax(dim=-2, keepdim=True).sub_(lo).clamp_min_(eps)
        return _channel_std_((x[:, :, :-1] - lo).div_(span_)).softmax(dim=-1)

    scores = component(keys)
    if value_weight:
        v = component(values)
        scores = scores.add_(v if value_weight == 1 else v.mul_(value_weight))  # w * v, then add: as written
    return scores


def lagkv_stored_length(n: int, sink_size: int, lag_size: int, keep_ratio: float) -> int:
    """Entries LagKV's reference mode stores after `n` tokens (paper Eq. 12 with `floor(r * L)`)."""
    if n < sink_size + 2 * lag_size:
        return n
    parts, rest = divmod(n - sink_size, lag_size)
    return sink_size + math.floor(keep_ratio * lag_size) * (parts - 1) + lag_size + rest


def lagkv_keep_ratio_for(compression_ratio: float, length: int, sink_size: int = 16, lag_size: int = 128) -> float:
    """The largest per-partition `keep_ratio` (a multiple of `1 / lag_size`) whose cache, after `length`
    tokens, removes at least `compression_ratio` of them (paper Eq. 12-13 solved for r)."""
    check_compression_ratio(compression_ratio)
    if compression_ratio == 0:
        return 1.0
    check(
        length >= sink_size + 2 * lag_size,
        f"LagKV does not compress {length} tokens (needs at least sink_size + 2 * lag_size = "
        f"{sink_size + 2 * lag_size})",
    )
    parts, rest = divmod(length - sink_size, lag_size)
    budget = (1 - compression_ratio) * length - sink_size - lag_size - rest
    k = min(lag_size, math.floor(budget / (parts - 1) + 1e-9))
    check(
        k >= 1,
        f"compression ratio {compression_ratio} is out of reach for {length} tokens with sink_size={sink_size}, "
        f"lag_size={lag_size} (the sinks and the window alone keep more)",
    )
    return k / lag_size


def lagkv_select_reference(
    keys: torch.Tensor,
    values: torch.Tensor,
    sink_size: int,
    lag_size: int,
    keep_ratio: float,
    compressed: int = 0,
    value_weight: float = 1.0,
    eps: float = 1e-6,
) -> tuple[torch.Tensor | None, int]:
    """One incremental LagKV step on a stored cache.

    Args:
        keys, values: `(batch, kv_heads, n, head_dim)`: sinks, `compressed` already compressed entries,
            then the uncompressed window.
    Returns:
        `(keep, compressed')`: indices `(batch, kv_heads, n_keep)` sorted ascending (None when nothing is
        due) and the new length of the compressed region.
    """
    n = keys.shape[-2]
    base = sink_size + compressed
    if n - base < 2 * lag_size:
        return None, compressed
    parts = (n - base) // lag_size
    scored = parts - 1
    k = math.floor(keep_ratio * lag_size)
    if k >= lag_size:
        return None, compressed + scored * lag_size
    end = base + parts * lag_size
    scores = lag_relative_scores(keys[:, :, base:end], values[:, :, base:end], lag_size, value_weight, eps)
    top = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values  # (b, h, scored, k)
    offsets = base + lag_size * torch.arange(scored, device=keys.device)
    picked = (top + offsets[:, None]).flatten(-2)
    keep = torch.cat([span(0, base, keys), picked, span(base + scored * lag_size, n, keys)], dim=-1)
    return keep, compressed + scored * k


def lagkv_global_scores(
    keys: torch.Tensor,
    values: torch.Tensor,
    sink_size: int,
    lag_size: int,
    value_weight: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor | None:
    """kvpress-style global scores: each partition's rank of the lag-relative score, divided by
    `lag_size` (in [0, 1)); sinks and the window (last full partition + remainder) score 2 (always kept
    first). `(batch, kv_heads, n)` float32, or None when `n < sink_size + 2 * lag_size` (not compressed).
    One top-k per head over these scores keeps the global budget (ties -> earlier entry)."""
    b, h, n, _ = keys.shape
    if n < sink_size + 2 * lag_size:
        return None
    parts = (n - sink_size) // lag_size
    end = sink_size + (parts - 1) * lag_size  # the last full partition and the remainder stay
    scores = lag_relative_scores(
        keys[:, :, sink_size : end + lag_size], values[:, :, sink_size : end + lag_size], lag_size, value_weight, eps
    )
    ranks = scores.argsort(dim=-1).argsort(dim=-1).float() / lag_size  # in [0, (L-1)/L]
    full = torch.full((b, h, n), 2.0, device=keys.device)
    full[:, :, sink_size:end] = ranks.flatten(-2)
    return full


def lagkv_select_global(
    keys: torch.Tensor,
    values: torch.Tensor,
    sink_size: int,
    lag_size: int,
    compression_ratio: float,
    value_weight: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor | None:
    """kvpress-style one-shot LagKV as one pure function (what the global mode does when the prompt
    ends): indices `(batch, kv_heads, kept_count(n, compression_ratio))` sorted ascending, or None."""
    n_keep = kept_count(keys.shape[-2], compression_ratio)
    scores = lagkv_global_scores(keys, values, sink_size, lag_size, value_weight, eps)
    if scores is None or n_keep >= keys.shape[-2]:
        return None
    return top_indices(scores, n_keep)  # ties -> earlier entry


# ---- the method ---------------------------------------------------------------------------------
@dataclass
class _LagState:
    compressed: int = 0  # entries in the compressed region (after the sinks)


@dataclass(kw_only=True)
class LagKV(ScoringMethod):
    """LagKV eviction. Reference mode by default; `compression_ratio=` (or `budget=`) selects the
    global-budget mode.

    Args:
        sink_size: first entries never evicted (S).
        lag_size: partition length (L).
        keep_ratio: fraction of each partition kept (r, the official `ratio`), in (0, 1]; default 0.5.
        compression_ratio: global-budget mode: fraction of the prompt removed, in [0, 1).
        budget: global-budget mode with an absolute number of entries per KV head (kvtrim sizing).
        value_weight: weight of the value score (`score_v_ratio`; 1.0 in the paper), finite, >= 0.
        skip_layers: layer indices left uncompressed.
        eps: lower bound of the min-max range (zero-range guard), > 0.
    """

    name = "lagkv"
    summary = "lag-relative K/V statistics per partition; attention-free (LagKV)"
    size_params = ("keep_ratio", "budget", "compression_ratio")
    headwise_refusal = ("its global scores are per-partition ranks, the same in every head "
                        "(a top-k across heads allocates uniformly)")

    sink_size: int = 16
    lag_size: int = 128
    keep_ratio: float | None = None
    value_weight: float = 1.0
    skip_layers: tuple[int, ...] = ()
    eps: float = 1e-6

    def check_size(self):
        given = [p for p in self.size_params if getattr(self, p) is not None]
        check(len(given) <= 1, f"LagKV takes keep_ratio= (reference mode) or compression_ratio= / budget= "
                               f"(global-budget mode), not both (got {' and '.join(given)})")
        if not given:
            self.keep_ratio = 0.5
        if self.keep_ratio is None:
            super().check_size()

    def __post_init__(self):
        super().__post_init__()
        check(self.sink_size >= 0, f"sink_size must be >= 0, got {self.sink_size}")
        check(self.lag_size >= 1, f"lag_size must be >= 1, got {self.lag_size}")
        if self.keep_ratio is not None:
            check(0 < self.keep_ratio <= 1, f"keep_ratio must be in (0, 1], got {self.keep_ratio}")
            check(
                math.floor(self.keep_ratio * self.lag_size) >= 1,
                f"keep_ratio * lag_size must keep at least one token per partition "
                f"(got {self.keep_ratio} * {self.lag_size})",
            )
        check(self.value_weight >= 0, f"value_weight must be >= 0, got {self.value_weight}")
        check(self.eps > 0, f"eps must be > 0, got {self.eps}")
        check(all(i >= 0 for i in self.skip_layers), f"skip_layers must be layer indices >= 0, got {self.skip_layers}")

    @classmethod
    def at_budget(cls, budget, context_length, **params):
        """Reference mode with the largest keep_ratio whose cache after `context_length` tokens fits
        `budget` (Eq. 12-13). For the global-budget mode build `LagKV(compression_ratio=...)` directly."""
        clash = sorted(set(params) & set(cls.size_params))
        check(not clash, f"lagkv: {', '.join(clash)} fixes the size already; the sweep sizes it by budget")
        sink, lag = params.get("sink_size", 16), params.get("lag_size", 128)
        check(isinstance(lag, int) and lag >= 1, f"lagkv: lag_size must be an integer >= 1, got {lag!r}")
        ratio = 1 - budget / context_length
        return cls(keep_ratio=lagkv_keep_ratio_for(ratio, context_length, sink, lag), **params)

    def check_config(self, config):
        layers = getattr(config.get_text_config(decoder=True), "num_hidden_layers", None)
        beyond = [i for i in self.skip_layers if layers is not None and i >= layers]
        check(not beyond, f"skip_layers {beyond} beyond the model's {layers} layers (0..{layers - 1 if layers else 0})")

    def evicts_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.skip_layers

    def layers_alike(self):  # the compressed count in its state follows the token count
        return not self.skip_layers

    def stored_after(self, tokens):
        # reference mode: the same cut whatever the forwards' split (the grid is anchored after the sinks);
        # with keep_ratio=1 its state moves on while nothing leaves (it keeps everything: stand-in keys)
        if self.mode != "reference" or self.skip_layers or math.floor(self.keep_ratio * self.lag_size) >= self.lag_size:
            return None
        return lagkv_stored_length(tokens, self.sink_size, self.lag_size, self.keep_ratio)

    @property
    def mode(self) -> str:
        return "reference" if self.keep_ratio is not None else "global"

    def new_state(self, layer_idx):
        return _LagState()

    # global-budget mode: a ScoringMethod acting once, when the prompt ends
    def score(self, view):
        return lagkv_global_scores(view.keys, view.values, self.sink_size, self.lag_size, self.value_weight, self.eps)

    def on_update(self, view):
        if view.layer_idx in self.skip_layers:
            return None
        if self.mode == "global":
            return super().on_update(view)
        keep, view.state.compressed = lagkv_select_reference(
            view.keys, view.values, self.sink_size, self.lag_size, self.keep_ratio,
            view.state.compressed, self.value_weight, self.eps,
        )
        return keep

    def peak_stored(self, prompt_tokens, total_tokens):
        if self.skip_layers:  # an uncompressed layer holds everything
            return total_tokens
        if self.mode == "global":  # the base's rule, except that a prompt too short to score stays whole
            short = prompt_tokens < self.sink_size + 2 * self.lag_size
            return total_tokens if short else self._scheduled_peak(prompt_tokens, total_tokens)
        # reference mode: the window past the sinks and compressed entries is cut when it reaches 2 * lag_size
        sink, lag, k = self.sink_size, self.lag_size, min(self.lag_size, math.floor(self.keep_ratio * self.lag_size))
        stored, compressed, n = prompt_tokens, 0, prompt_tokens
        while True:
            window = stored - sink - compressed
            if window >= 2 * lag:  # all complete partitions but the newest are cut to k entries each
                scored = window // lag - 1
                compressed += scored * k
                stored -= scored * (lag - k)
                window -= scored * lag
            if n == prompt_tokens:
                peak = stored  # what the prompt's end keeps
            if n == total_tokens:
                return peak
            grow = min(total_tokens - n, 2 * lag - window)  # decode steps until the next cut (or the end)
            n, stored = n + grow, stored + grow
            peak = max(peak, stored)

    def on_prompt_end(self, view):
        if view.layer_idx in self.skip_layers or self.mode == "reference":
            return None
        return super().on_prompt_end(view)
