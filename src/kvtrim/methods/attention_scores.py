"""Pure helpers shared by the attention-based methods (SnapKV, H2O, TOVA, LazyEviction).

Shapes: queries `(batch, q_heads, q_len, head_dim)` (post-RoPE, as kvtrim's attention function hands
them over), keys `(batch, kv_heads, n, head_dim)`; query head `h` belongs to KV head `h // group`
(the `repeat_kv` convention of `transformers`).
"""

from __future__ import annotations

import torch


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`(batch, q_heads, ...)` -> `(batch, kv_heads, group, ...)`."""
    return x.view(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def causal_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention (float32) of the last `q_len` positions of the sequence over all `n` keys.

    Query `i` sits at position `n - q_len + i` and sees keys `0 .. n - q_len + i` (causal, no padding).

    Returns:
        `(batch, kv_heads, group, q_len, n)` probabilities.
    """
    b, h, q, d = queries.shape
    hkv, n = keys.shape[1], keys.shape[2]
    logits = torch.matmul(grouped(queries.float(), hkv), keys.float()[:, :, None].transpose(-1, -2)) * scaling
    future = torch.arange(n, device=keys.device)[None, :] > (n - q + torch.arange(q, device=keys.device))[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1)
