"""kvtrim's attention functions: attend, then hand the queries (and probabilities) to the cache layer.

Two functions are registered with `transformers`' `AttentionInterface` (and the matching mask builders
with `AttentionMaskInterface`) under new names, so nothing of `transformers` is patched:

* `"kvtrim_sdpa"` wraps SDPA. With no method waiting (attention-free methods, layers that do not evict,
  prefill of methods that only need queries) it *is* stock SDPA: the output is bit-identical.
  For single-token decode steps of a method that `needs_attention`, it computes
  `probs = softmax(q K^T * scale + mask)` (float32 softmax, as eager attention does) and
  `output = probs @ V` itself, per GQA group without repeating K/V, and hands those very `probs` to
  the method: the method sees the probabilities that produced the output, not a recomputation.
* `"kvtrim_eager"` wraps the model's own eager attention (`eager_attention_forward` of its modeling
  module), whose returned weights are the probabilities that produced the output.

A ragged cache layer (`TrimLayer.is_ragged`: rows of unequal lengths) is attended by
`kvtrim.ragged_attention` over the step's padded view with its own mask (the model's mask, built for
another layout, is ignored), or flash-attn's varlen kernel where it applies; the probability path
returns probabilities over the padded view (0 at its filler entries).

After the output is computed, `take_pending_layer(module.layer_idx)` returns the `TrimLayer` whose method
waits (see `kvtrim.cache`), and it gets `after_attention(queries, probs, scaling)` with the post-RoPE
queries `(batch, q_heads, q_len, head_dim)` and, for decode steps of methods that need them, the
probabilities `(batch, q_heads, 1, n_stored)`.

Use: `kvtrim.enable(model)` (done by `kvtrim.models.load_model` unless `kvtrim_attention=False`).
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from kvtrim.cache import TrimLayer, record_padding_mask, take_pending_layer
from kvtrim.methods.base import KvtrimError, check
from kvtrim.ragged_attention import flash_varlen_available, ragged_attention, ragged_attention_with_probabilities

SDPA = "kvtrim_sdpa"
EAGER = "kvtrim_eager"
#: stock implementation -> kvtrim's wrapper
WRAPPERS = {"sdpa": SDPA, "eager": EAGER}
STOCK = {v: k for k, v in WRAPPERS.items()}


# ---- the probability path (pure) -----------------------------------------------------------------
def attend_with_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention that also returns its probabilities.

    Args:
        query: `(batch, q_heads, q_len, head_dim)`; key, value: `(batch, kv_heads, n, head_dim)`, with
            `q_heads` a multiple of `kv_heads` (query head `h` reads KV head `h // group`, as `repeat_kv`).
        attention_mask: None, boolean (True = attend) or additive float, broadcastable to
            `(batch, 1, q_len, n)`.
    Returns:
        `(output (batch, q_len, q_heads, head_dim), probs (batch, q_heads, q_len, n))` where
        `output == probs @ V` exactly (`probs` in the query dtype, softmax computed in float32).
    """
    b, h, q, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    group = h // hkv
    # (b * hkv, group * q, d): each KV head's query heads side by side, no K/V copy. `bmm` on the
    # (batch * kv_heads) matrices gives matmul's bits on the 4-D tensors with less dispatch, and the scale
    # is applied in place: this runs at every decode step of every layer (H2O, TOVA, LazyEviction)
    logits = torch.bmm(query.reshape(b * hkv, group * q, d), key.reshape(b * hkv, n, d).transpose(1, 2))
    probs = softmax_probabilities(logits.view(b, h, q, n), attention_mask, scaling, softcap)
    out = torch.bmm(probs.view(b * hkv, group * q, n), value.reshape(b * hkv, n, value.shape[-1]))
    out = out.view(b, h, q, value.shape[-1])
    return out.transpose(1, 2).contiguous(), probs


def softmax_probabilities(
    logits: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """`(batch, q_heads, q_len, n)` unscaled `QK^T` in the query dtype -> kvtrim's attention probabilities (scaled
    in place, soft-capped, masked, softmax in float32, back to the query dtype): the one rule for
    `attend_with_probabilities` and kvtrim's vLLM worker, which computes the product from its key blocks."""
    dtype = logits.dtype
    logits = logits.mul_(scaling)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attention_mask, torch.finfo(logits.dtype).min)
        else:
            logits = logits + attention_mask
    return torch.softmax(logits, dim=-1, dtype=torch.float32).to(dtype)


def _pending(module, kwargs: dict) -> TrimLayer | None:
    """The evicting layer this attention call belongs to (None for other caches / layers)."""
    idx = getattr(module, "layer_idx", None)
    layer = None if idx is None else take_pending_layer(idx)
    if layer is not None and kwargs.get("sliding_window") is not None:
        raise KvtrimError(
            "this model has sliding-window layers: build the cache with TrimCache(method, config=model.config) "
            "so that they are left alone"
        )
    return layer


def _wants_probs(layer: TrimLayer | None, query: torch.Tensor) -> bool:
    return layer is not None and layer.awaiting_attention and layer.method.needs_attention and query.shape[2] == 1


def _hand_over(layer: TrimLayer | None, query: torch.Tensor, probs: torch.Tensor | None, scale: float) -> None:
    if layer is not None and layer.awaiting_attention:
        layer.after_attention(query, probs, scale)


def _ragged(layer: TrimLayer | None, query: torch.Tensor, scaling: float | None, dropout: float, kwargs: dict):
    """`(output (b, q, q_heads, d), probs or None)` for a ragged layer's step, else None (a dense layer)."""
    step = None if layer is None else layer.take_ragged_step()
    if step is None:
        return None
    view, storage, query_positions, query_valid = step
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    unsupported = [k for k in ("position_bias", "s_aux", "sinks") if kwargs.get(k) is not None]
    check(not unsupported, f"ragged kvtrim attention does not support {', '.join(unsupported)} yet")
    check(dropout == 0.0, "ragged kvtrim attention runs in eval mode only (dropout > 0)")
    softcap = kwargs.get("softcap")
    if _wants_probs(layer, query):
        kv = view if view is not None else layer.padded_view()
        out, probs = ragged_attention_with_probabilities(query, kv, query_positions, query_valid, scaling=scale,
                                                         softcap=softcap)
    else:
        if storage is not None and flash_varlen_available(query):  # reads the storage: it ends with this step
            kv = storage
        else:
            kv = view if view is not None else layer.padded_view()
        out, probs = ragged_attention(query, kv, query_positions, query_valid, scaling=scale, softcap=softcap), None
    _hand_over(layer, query, probs, scale)
    return out, probs


def fit_mask(mask: torch.Tensor | None, kv_length: int) -> torch.Tensor | None:
    """A mask built for another layer's stored length, refitted to `kv_length` entries.

    `transformers` builds one mask per forward, sized from the first full-attention layer. Layers that
    hold a different number of entries (LagKV `skip_layers`) need the same pattern at their own length:
    every stored entry visible (padding is refused by `TrimCache`), then the new tokens' causal block.
    """
    if mask is None or mask.shape[-1] == kv_length:
        return mask
    q = mask.shape[-2]
    stored = mask[..., :1].expand(*mask.shape[:-1], kv_length - q)
    return torch.cat([stored, mask[..., -q:]], dim=-1)


# ---- the registered functions --------------------------------------------------------------------
def kvtrim_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA, plus the hand-off to a waiting `TrimLayer` (see the module docstring)."""
    layer = _pending(module, kwargs)
    ragged = _ragged(layer, query, scaling, dropout, kwargs)
    if ragged is not None:
        return ragged[0], None
    attention_mask = fit_mask(attention_mask, key.shape[-2])
    if not _wants_probs(layer, query):
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
        _hand_over(layer, query, None, scaling if scaling is not None else query.shape[-1] ** -0.5)
        return out, None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    unsupported = [k for k in ("position_bias", "s_aux", "sinks") if kwargs.get(k) is not None]
    check(not unsupported, f"kvtrim attention cannot return probabilities with {', '.join(unsupported)} yet")
    check(dropout == 0.0, "kvtrim attention with attention-based eviction runs in eval mode only (dropout > 0)")
    out, probs = attend_with_probabilities(query, key, value, attention_mask, scale, kwargs.get("softcap"))
    _hand_over(layer, query, probs, scale)
    return out, None


def _generic_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain eager attention (used when a model's modeling module has no `eager_attention_forward`)."""
    key = repeat_kv(key, getattr(module, "num_key_value_groups", 1))
    value = repeat_kv(value, getattr(module, "num_key_value_groups", 1))
    out, probs = attend_with_probabilities(query, key, value, attention_mask, scaling, kwargs.get("softcap"))
    return out, probs


def _model_eager(module):
    """The eager attention of the model's own modeling module (what `attn_implementation="eager"` runs)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else _generic_eager


def kvtrim_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's eager attention, plus the hand-off of its own weights to a waiting `TrimLayer`."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = _pending(module, kwargs)
    ragged = _ragged(layer, query, scale, dropout, kwargs)
    if ragged is not None:
        return ragged
    attention_mask = fit_mask(attention_mask, key.shape[-2])
    out, weights = _model_eager(module)(module, query, key, value, attention_mask, scaling=scale, dropout=dropout,
                                        **kwargs)
    _hand_over(layer, query, weights if _wants_probs(layer, query) else None, scale)
    return out, weights


# ---- switching a model ---------------------------------------------------------------------------
def kvtrim_sdpa_mask(*args, **kwargs):
    """The stock SDPA mask builder, after recording the forward's 2D padding mask for `TrimCache`
    (which of this step's tokens are pads: a padded batch never stores them)."""
    record_padding_mask(kwargs.get("attention_mask"))
    return sdpa_mask(*args, **kwargs)


def kvtrim_eager_mask(*args, **kwargs):
    """The stock eager mask builder, after recording the forward's 2D padding mask (as `kvtrim_sdpa_mask`)."""
    record_padding_mask(kwargs.get("attention_mask"))
    return eager_mask(*args, **kwargs)


def register() -> None:
    """Register kvtrim's attention functions and their mask builders (idempotent)."""
    AttentionInterface.register(SDPA, kvtrim_sdpa_attention)
    AttentionInterface.register(EAGER, kvtrim_eager_attention)
    AttentionMaskInterface.register(SDPA, kvtrim_sdpa_mask)
    AttentionMaskInterface.register(EAGER, kvtrim_eager_mask)


def _implementation(model) -> str | None:
    return getattr(model.config, "_attn_implementation", None)


def is_enabled(model) -> bool:
    """True when `model` runs kvtrim's attention function."""
    return _implementation(model) in STOCK


def enable(model):
    """Switch `model` to kvtrim's attention ("sdpa" -> "kvtrim_sdpa", "eager" -> "kvtrim_eager").

    Needed by methods that use queries or attention probabilities (SnapKV, H2O, TOVA, LazyEviction);
    harmless otherwise (outputs are unchanged). Returns the model. Uses the public
    `model.set_attn_implementation`; `kvtrim.disable(model)` switches back.
    """
    register()
    current = _implementation(model)
    if current in STOCK:
        return model
    check(
        current in WRAPPERS,
        f"kvtrim attention wraps 'sdpa' or 'eager', but this model uses '{current}': load it with "
        "attn_implementation='sdpa'",
    )
    model.set_attn_implementation(WRAPPERS[current])
    if _implementation(model) != WRAPPERS[current]:
        raise KvtrimError(f"{type(model).__name__} does not support switching its attention implementation")
    return model


def disable(model):
    """Switch `model` back to the stock attention it wrapped. Returns the model."""
    current = _implementation(model)
    if current in STOCK:
        model.set_attn_implementation(STOCK[current])
    return model
