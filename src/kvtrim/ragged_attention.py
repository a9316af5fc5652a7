"""Attention over ragged KV storage (`kvtrim.storage.RaggedKV`).

Semantics (one rule for every backend): the `q` new tokens of this step have already been appended to
the storage (the cache layer appends in `update`, attention runs, then the method evicts: "attend, then
evict"). Query `i` of sequence `b`, query head `hq`, reads KV row `(b, hq // group)` and sees the row's
stored entries whose position is `<= query_positions[b, i]`: every older entry plus the causal part of
this step's block. Queries marked invalid (pads of a padded batch) see nothing; their output is 0.

Backends:

* `"sdpa"` (the CPU default, and the GPU fallback): `torch.nn.functional.scaled_dot_product_attention`
  over the transient padded view `(b, kv_heads, W, d)` with a boolean mask `(b, kv_heads, q, W)`; each
  `(sequence, kv_head)` row is one batch entry whose heads are its group of query heads, so the mask
  broadcasts over the group (no copy per query head, no K/V repeat).
* FlexAttention (`torch.nn.attention.flex_attention`) was measured and left out (benchmarks/ragged):
  on CPU with torch 2.13, `create_block_mask` alone costs more per step than the whole SDPA path, and
  compiling with dynamic shapes (needed: the view's width changes every step) fails in Inductor's C++
  code generation; static shapes recompile at every new width.
* `"flash"`: flash-attn's `flash_attn_varlen_func` when `flash_attn` is importable, the tensors are on a
  GPU in fp16/bf16: each `(sequence, kv_head)` row is one varlen sequence of `lengths[b, h]` keys
  (gathered back to back from the pool) and the row's valid queries × its group of query heads
  (nheads = group, nheads_k = 1); causality is flash-attn's bottom-right alignment, which is right
  because this step's tokens are the last entries of each row. Untested here (no GPU, flash-attn not
  installed). flash-attn's paged kv-cache functions are not used: they need pages of 256 entries, which
  the storage's 2 % memory bound rules out for short rows (see `kvtrim.storage`).

`"auto"` picks `"flash"` when it applies, else `"sdpa"`.

`ragged_attention_with_probabilities` is the explicit path for decode steps of methods that need the
probabilities: `output == probs @ V` exactly, `probs` aligned with the padded view (0 at pads).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from kvtrim.methods.base import check
from kvtrim.storage import PaddedView, RaggedKV

BACKENDS = ("auto", "sdpa", "flash")


@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def flash_varlen_available(query: torch.Tensor) -> bool:
    """True when the flash-attn varlen path applies: flash_attn importable, CUDA tensor, fp16/bf16, d <= 256."""
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] <= 256
        and _flash_attn_installed()
    )


def _check_query(query: torch.Tensor, kv_heads: int, batch: int, head_dim: int) -> tuple[int, int, int, int]:
    check(query.ndim == 4, f"query must be (batch, q_heads, q, head_dim), got {tuple(query.shape)}")
    b, hq, q, d = query.shape
    check(b == batch and d == head_dim, f"query {tuple(query.shape)} does not match storage (batch {batch}, "
                                        f"head_dim {head_dim})")
    check(hq % kv_heads == 0, f"query heads ({hq}) must be a multiple of KV heads ({kv_heads})")
    return b, hq, q, d


def _query_inputs(query_positions, query_valid, b: int, q: int, device):
    check(isinstance(query_positions, torch.Tensor) and tuple(query_positions.shape) == (b, q),
          f"query_positions must be ({b}, {q})")
    query_positions = query_positions.to(device).long()
    if query_valid is not None:
        check(isinstance(query_valid, torch.Tensor) and query_valid.dtype == torch.bool
              and tuple(query_valid.shape) == (b, q), f"query_valid must be a bool tensor ({b}, {q})")
        query_valid = query_valid.to(device)
    return query_positions, query_valid


def ragged_mask(view: PaddedView, query_positions: torch.Tensor, query_valid: torch.Tensor | None = None) -> torch.Tensor:
    """`(batch, kv_heads, q, width)` bool: query `i` of row `(b, h)` sees entry `j` (stored, not in its future)."""
    mask = view.valid[:, :, None, :] & (view.positions[:, :, None, :] <= query_positions[:, None, :, None])
    if query_valid is not None:
        mask = mask & query_valid[:, None, :, None]
    return mask


def _grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`(b, q_heads, q, d)` -> `(b, kv_heads, group * q, d)`: each KV head's query heads side by side."""
    b, hq, q, d = query.shape
    return query.reshape(b, kv_heads, (hq // kv_heads) * q, d)


def _ungrouped(out: torch.Tensor, hq: int) -> torch.Tensor:
    """`(b, kv_heads, group * q, d)` -> `(b, q, q_heads, d)` (the layout attention functions return)."""
    b, hkv, gq, d = out.shape
    return out.reshape(b, hq, gq * hkv // hq, d).transpose(1, 2).contiguous()


def _sdpa(query, view: PaddedView, mask, query_valid, scaling):
    """SDPA with every `(sequence, kv_head)` row as one batch entry and its query heads as heads: the
    mask `(b * kv_heads, 1, q, W)` broadcasts over the group (no per-head copy of the mask, no K/V repeat)."""
    b, hq, q, d = query.shape
    hkv, w = view.keys.shape[1], view.width
    g = hq // hkv
    out = F.scaled_dot_product_attention(
        query.reshape(b * hkv, g, q, d), view.keys.reshape(b * hkv, 1, w, d), view.values.reshape(b * hkv, 1, w, d),
        attn_mask=mask.reshape(b * hkv, 1, q, w), scale=scaling, enable_gqa=True,
    ).view(b, hq, q, d)
    if query_valid is not None:  # pad queries see nothing: 0 (SDPA's safe softmax agrees; be explicit)
        out = out.masked_fill(~query_valid[:, None, :, None], 0.0)
    return out.transpose(1, 2).contiguous()


def _flash_varlen(query, kv: RaggedKV, query_valid, scaling, softcap):
    """flash-attn varlen over rows `(sequence, kv_head)`; see the module docstring. Untested here."""
    from flash_attn import flash_attn_varlen_func

    b, hq, q, d = query.shape
    hkv = kv.kv_heads
    g = hq // hkv
    keys, values, cu_k = kv.packed_rows()
    qvalid = torch.ones(b, q, dtype=torch.bool, device=query.device) if query_valid is None else query_valid
    # queries of row (b, h): its valid tokens, each with the group's g heads -> (total_q, g, d)
    per_row = query.reshape(b, hkv, g, q, d).permute(0, 1, 3, 2, 4)  # (b, hkv, q, g, d)
    rows_valid = qvalid[:, None, :].expand(b, hkv, q)
    packed_q = per_row[rows_valid]
    cu_q = torch.zeros(b * hkv + 1, dtype=torch.int32, device=query.device)
    cu_q[1:] = rows_valid.sum(-1).reshape(-1).cumsum(0)
    extra = {} if softcap is None else {"softcap": softcap}  # the keyword exists from flash-attn 2.6 on
    out = flash_attn_varlen_func(
        packed_q, keys.unsqueeze(1), values.unsqueeze(1), cu_q, cu_k,
        int(rows_valid.sum(-1).max()), int(kv.lengths.max()),
        softmax_scale=scaling, causal=True, **extra,
    )
    full = per_row.new_zeros(b, hkv, q, g, d)
    full[rows_valid] = out
    return full.permute(0, 2, 1, 3, 4).reshape(b, q, hq, d)


def ragged_attention(
    query: torch.Tensor,
    kv: RaggedKV | PaddedView,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor | None = None,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of this step's queries over ragged storage that already holds this step's entries.

    Args:
        query: `(batch, q_heads, q, head_dim)`, post-RoPE; `q_heads` a multiple of the storage's KV heads.
        kv: the layer's `RaggedKV`, or a `PaddedView` of it already built this step (reused, not rebuilt).
        query_positions: `(batch, q)` true positions of the new tokens (pads: anything).
        query_valid: `(batch, q)` bool, False for pads (output 0); default all valid.
        scaling: softmax scale (default `head_dim ** -0.5`); softcap: tanh soft-capping of the logits
            (SDPA cannot apply it: such calls use the explicit path).
        backend: one of `BACKENDS` (see the module docstring).
    Returns:
        `(batch, q, q_heads, head_dim)`.
    """
    check(backend in BACKENDS, f"unknown ragged attention backend '{backend}' (choose from {', '.join(BACKENDS)})")
    batch, hkv = (kv.batch, kv.kv_heads) if isinstance(kv, RaggedKV) else tuple(kv.lengths.shape)
    head_dim = kv.head_dim if isinstance(kv, RaggedKV) else kv.keys.shape[-1]
    b, hq, q, d = _check_query(query, hkv, batch, head_dim)
    query_positions, query_valid = _query_inputs(query_positions, query_valid, b, q, query.device)
    scale = d ** -0.5 if scaling is None else scaling
    if backend == "flash" or (backend == "auto" and isinstance(kv, RaggedKV) and flash_varlen_available(query)):
        check(isinstance(kv, RaggedKV), "the flash backend reads the storage itself: pass the RaggedKV, not a view")
        check(flash_varlen_available(query), "the flash backend needs flash_attn and fp16/bf16 CUDA tensors")
        return _flash_varlen(query, kv, query_valid, scale, softcap)
    view = kv.padded() if isinstance(kv, RaggedKV) else kv
    if softcap is not None:
        return ragged_attention_with_probabilities(query, view, query_positions, query_valid, scaling=scale,
                                                   softcap=softcap)[0]
    return _sdpa(query, view, ragged_mask(view, query_positions, query_valid), query_valid, scale)


def ragged_attention_with_probabilities(
    query: torch.Tensor,
    kv: RaggedKV | PaddedView,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor | None = None,
    *,
    scaling: float | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention that also returns its probabilities (decode steps of attention-based methods).

    Same arguments as `ragged_attention`. Returns `(output (batch, q, q_heads, head_dim),
    probs (batch, q_heads, q, width))`, `probs` over the padded view (0 at pads, future entries and for
    invalid queries), softmax in float32 then cast to the query dtype, and `output == probs @ V` exactly.
    """
    batch, hkv = (kv.batch, kv.kv_heads) if isinstance(kv, RaggedKV) else tuple(kv.lengths.shape)
    head_dim = kv.head_dim if isinstance(kv, RaggedKV) else kv.keys.shape[-1]
    b, hq, q, d = _check_query(query, hkv, batch, head_dim)
    query_positions, query_valid = _query_inputs(query_positions, query_valid, b, q, query.device)
    scale = d ** -0.5 if scaling is None else scaling
    view = kv.padded() if isinstance(kv, RaggedKV) else kv
    g, w = hq // hkv, view.width
    logits = torch.matmul(_grouped(query, hkv), view.keys.transpose(-1, -2)) * scale  # (b, hkv, g*q, w)
    logits = logits.view(b, hkv, g, q, w)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    mask = ragged_mask(view, query_positions, query_valid)[:, :, None]  # (b, hkv, 1, q, w)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
    probs = torch.where(mask.any(-1, keepdim=True), probs, 0.0).to(query.dtype)  # rows that see nothing: 0, not NaN
    out = torch.matmul(probs.view(b, hkv, g * q, w), view.values)
    return _ungrouped(out, hq), probs.view(b, hq, q, w)


__all__ = ["BACKENDS", "flash_varlen_available", "ragged_attention", "ragged_attention_with_probabilities",
           "ragged_mask"]
