"""Chunked / block-wise prefill: feed a long prompt through the model a block at a time.

Each block attends only to what the cache retained from earlier blocks plus itself (causally), so an
evicting cache bounds the peak KV memory of the prefill, not only what is left after it:

* KeyDiff (`budget=`): blocks of `block_size` keep every layer at or below `budget + block_size`
  entries per KV head for any prompt length (the paper's block-wise prompt processing);
* LagKV: `prefill_lagkv` feeds the first `sink_size + 2 * lag_size` tokens, then `lag_size` per chunk
  (paper section 4.3, the official README's `inference_by_prefill_compress`); the peak is about
  `S + r (n - S) + 2 L` instead of `n`.

Unlike a one-shot prefill, this changes the outputs whenever entries are evicted before the prompt
ends: later prompt tokens never see what earlier blocks evicted (the paper reports a first-generated-
token accuracy of about 80% at 8x for LagKV's chunked mode; on SmolLM2-135M passkey at ~1.8k tokens
and 3.3x, LagKV went from 4/5 one-shot to 3/5 chunk-by-chunk, KeyDiff from 5/5 to 4/5 block-wise).
With a cache that evicts nothing, chunked and one-shot prefill agree up to float rounding.

Positions: each block gets its true absolute `position_ids` (tokens seen so far + offset), never the
stored length. The causal mask comes from the cache: `TrimCache.get_mask_sizes(q)` is
`(stored + q, seen - stored)`, i.e. every stored entry is visible and the block is causal inside.

`model.generate(input_ids, cache=TrimCache(...), prefill_chunk_size=B)` gives the same block-wise
behaviour inside stock `generate` (it passes the positions it derives from the attention mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtrim.attention import is_enabled
from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.methods.base import KvtrimError, Phase, check
from kvtrim.methods.lagkv import LagKV


def lagkv_chunk_sizes(n: int, sink_size: int, lag_size: int) -> list[int]:
    """LagKV's chunk-by-chunk prefill schedule for `n` tokens: `sink_size + 2 * lag_size` first (the
    first length at which LagKV compresses), then `lag_size` per chunk (each compresses one partition);
    the last chunk takes the remainder. A prompt no longer than the first chunk goes in one piece."""
    check(n >= 1, f"the prompt must have at least one token, got {n}")
    check(sink_size >= 0 and lag_size >= 1, f"need sink_size >= 0 and lag_size >= 1, got {sink_size}, {lag_size}")
    first = sink_size + 2 * lag_size
    if n <= first:
        return [n]
    full, rest = divmod(n - first, lag_size)
    return [first] + [lag_size] * full + ([rest] if rest else [])


def _chunk_sizes(n: int, chunk_size: int | None, chunk_sizes: Sequence[int] | None) -> list[int]:
    check(chunk_size is None or chunk_sizes is None, "pass chunk_size= or chunk_sizes=, not both")
    if chunk_sizes is not None:
        sizes = [int(s) for s in chunk_sizes]
        check(all(s >= 1 for s in sizes), f"chunk sizes must be >= 1, got {sizes}")
        check(sum(sizes) == n, f"chunk sizes add up to {sum(sizes)}, but the prompt has {n} tokens")
        return sizes
    if chunk_size is None:
        return [n]
    check(chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size}")
    return [min(chunk_size, n - start) for start in range(0, n, chunk_size)]


def _check_equal_lengths(cache: TrimCache) -> None:
    """transformers builds one causal mask per forward, sized from the first full-attention layer: a
    multi-token forward under stock attention is only right when every evicting layer stores the same
    number of entries (kvtrim's attention refits the mask per layer, and attends ragged layers itself)."""
    stored = {layer.stored for layer in cache.layers if isinstance(layer, TrimLayer) and layer.is_initialized}
    if len(stored) > 1:
        raise KvtrimError(
            f"the cache layers store different numbers of entries ({min(stored)} to {max(stored)}, e.g. LagKV with "
            "skip_layers); a multi-token forward on such a cache would get a wrongly sized mask: prefill in one forward"
        )


@torch.no_grad()
def prefill(
    model,
    input_ids: torch.Tensor,
    cache: TrimCache,
    chunk_size: int | None = None,
    chunk_sizes: Sequence[int] | None = None,
    end_prompt: bool = True,
) -> torch.Tensor:
    """Run `input_ids` `(batch, n)` through `model` into `cache`, one chunk per forward.

    Continues after whatever `cache` already holds (positions start at `cache.get_seq_length()`), so a
    prompt can be fed in several calls. Batches must be unpadded: a padded batch goes through
    `padded_layout` + `prefill_padded` (as `kvtrim.compress` does), which give each sequence its own blocks.

    Phases: while the cache's prompt is open, every chunk is a prompt block (`Phase.PREFILL`) and the last
    one ends the prompt (unless `end_prompt=False`: more of the prompt follows in another call), so
    one-shot methods compress right after it. Once the prompt ended, the chunks are appends
    (`Phase.APPEND`: a question after a compressed context, a new turn).

    Args:
        chunk_size: tokens per forward; default: the cache method's block size (KeyDiff) when it has
            one, else the whole input in one forward.
        chunk_sizes: an explicit schedule instead (must add up to `n`), e.g. `lagkv_chunk_sizes(...)`.
        end_prompt: end the prompt with the last chunk (ignored once the prompt ended).
    Returns:
        the logits of the last prompt token, `(batch, vocab)`.

    Every forward asks for the last position's logits only (`logits_to_keep=1`), so the output layer
    costs one token per chunk and no `(chunk, vocab)` tensor is built. To decode afterwards with stock
    `generate`, prefill all but the last prompt token and pass the whole prompt with `cache=cache`.
    """
    check(isinstance(cache, TrimCache), f"prefill needs a TrimCache, got {type(cache).__name__}")
    check(input_ids.ndim == 2 and input_ids.shape[-1] >= 1, "input_ids must be (batch, n) with n >= 1")
    if chunk_size is None and chunk_sizes is None:
        chunk_size = cache.method.prefill_block_size()
    sizes = _chunk_sizes(input_ids.shape[-1], chunk_size, chunk_sizes)
    limit = getattr(model.config, "max_position_embeddings", None)
    start = cache.get_seq_length()
    check(
        limit is None or start + input_ids.shape[-1] <= limit,
        f"{start} cached plus {input_ids.shape[-1]} new tokens exceed the model's context of {limit} tokens",
    )
    input_ids = input_ids.to(model.device)
    cache.kvtrim_attention = cache.kvtrim_attention or is_enabled(model)
    b = input_ids.shape[0]
    phase = Phase.APPEND if cache.prompt_ended else Phase.PREFILL
    offset = 0
    for i, size in enumerate(sizes):
        if size > 1 and not is_enabled(model):
            _check_equal_lengths(cache)
        block = input_ids[:, offset : offset + size]
        pos = cache.get_seq_length()
        positions = torch.arange(pos, pos + size, device=model.device).expand(b, size)
        ends = phase is Phase.PREFILL and end_prompt and i == len(sizes) - 1 and not cache.method.cross_layer
        with cache.phase(phase, ends_prompt=ends):
            out = model(input_ids=block, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
        offset += size
    if phase is Phase.PREFILL and end_prompt and cache.method.cross_layer:
        cache.end_prompt()  # decided across layers, once every layer holds the whole prompt
    return out.logits[:, -1]


@torch.no_grad()
def prefill_lagkv(model, input_ids: torch.Tensor, cache: TrimCache) -> torch.Tensor:
    """LagKV's chunk-by-chunk prefill (paper section 4.3): bounded peak memory, changed outputs.

    `cache` must hold a LagKV method; the schedule is `lagkv_chunk_sizes(n, sink_size, lag_size)`
    (for a continued cache it restarts from the new tokens). Returns the last logits `(batch, vocab)`.
    """
    method = getattr(cache, "method", None)
    check(isinstance(method, LagKV), f"prefill_lagkv needs a TrimCache holding LagKV, got {type(method).__name__}")
    check(method.mode == "reference", "prefill_lagkv needs LagKV's reference mode (keep_ratio=), not compression_ratio")
    sizes = lagkv_chunk_sizes(input_ids.shape[-1], method.sink_size, method.lag_size)
    return prefill(model, input_ids, cache, chunk_sizes=sizes)


# ---- padded batches --------------------------------------------------------------------------------
def as_sequences(input_ids, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The real tokens of each sequence of a batch, as 1-D LongTensors.

    `input_ids`: a list of sequences (1-D tensors or lists of ints), or a `(batch, n)` tensor with its
    `attention_mask` `(batch, n)` (1 = token, 0 = pad; any side)."""
    if isinstance(input_ids, (list, tuple)):
        check(attention_mask is None, "a list of sequences carries its own lengths: pass no attention_mask")
        check(len(input_ids) >= 1, "the batch is empty")
        seqs = []
        for i, s in enumerate(input_ids):
            t = s if isinstance(s, torch.Tensor) else torch.tensor(list(s), dtype=torch.long)
            check(t.ndim == 1 and not t.is_floating_point() and t.dtype != torch.bool,
                  f"sequence {i} must be a 1-D list or tensor of token ids")
            seqs.append(t.long())
    else:
        check(isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2, "input_ids must be a (batch, n) tensor")
        check(isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape,
              f"attention_mask must be a tensor of the shape of input_ids {tuple(input_ids.shape)}")
        seqs = [row[m.bool()] for row, m in zip(input_ids, attention_mask.to(input_ids.device))]
    check(all(len(s) >= 1 for s in seqs), "every sequence needs at least one token")
    return seqs


def padded_layout(sequences: list[torch.Tensor], chunk_size: int | None,
                  pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Lay a padded batch out for a block-wise prefill that gives every sequence its own blocks.

    Each sequence is cut into blocks as alone (`chunk_size` tokens, the last one shorter); forward `t`
    holds block `t - (C - c_b)` of sequence `b` (`c_b` its block count, `C` the largest), left-padded
    to the forward's width: every sequence's last block falls in the last forward, and no forward
    mixes one sequence's blocks. Returns `(input_ids (batch, T), attention_mask (batch, T), widths)`,
    `widths` the columns of each forward (sum `T`). With `chunk_size=None`: one left-padded forward.
    """
    blocks = [_chunk_sizes(len(s), chunk_size, None) for s in sequences]
    count = max(len(z) for z in blocks)
    shifted = [[0] * (count - len(z)) + z for z in blocks]
    widths = [max(z[t] for z in shifted) for t in range(count)]
    total = sum(widths)
    ids = torch.full((len(sequences), total), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), total, dtype=torch.long)
    for b, (seq, z) in enumerate(zip(sequences, shifted)):
        start = taken = 0
        for width, size in zip(widths, z):
            cols = slice(start + width - size, start + width)
            ids[b, cols] = seq[taken : taken + size].to(ids.device)
            mask[b, cols] = 1
            start, taken = start + width, taken + size
    return ids, mask, widths


def layout_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's own positions `(batch, T)` (pads: 0), as `generate` derives them from the mask."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


@torch.no_grad()
def prefill_padded(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, widths: Sequence[int],
                   cache: TrimCache, end_prompt: bool = True) -> torch.Tensor:
    """Run the first `sum(widths)` columns of a `padded_layout` through `model` into a fresh `cache`, one
    forward per width (prompt blocks; the last ends the prompt when `end_prompt`). Needs kvtrim's
    attention (it tells the cache which tokens are pads). Returns the last column's logits `(batch, vocab)`."""
    check(isinstance(cache, TrimCache), f"prefill needs a TrimCache, got {type(cache).__name__}")
    check(is_enabled(model), "a padded batch needs kvtrim's attention function: call kvtrim.enable(model) or load "
                             "the model with kvtrim.load_model()")
    check(cache.get_seq_length() == 0, "a padded batch is prefilled into a fresh cache")
    check(not cache.method.cross_layer,
          f"{type(cache.method).__name__} decides across layers, which is not supported on a padded batch yet")
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = int(attention_mask.sum(-1).max())
    check(limit is None or longest <= limit, f"{longest} tokens exceed the model's context of {limit} tokens")
    cache.padded = True
    cache.kvtrim_attention = True
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    positions = layout_positions(attention_mask)
    start, out = 0, None
    for i, width in enumerate(widths):
        cols = slice(start, start + width)
        ends = end_prompt and i == len(widths) - 1
        with cache.phase(Phase.PREFILL, ends_prompt=ends):
            out = model(input_ids=input_ids[:, cols], attention_mask=attention_mask[:, : start + width],
                        position_ids=positions[:, cols], cache=cache, use_cache=True, logits_to_keep=1)
        start += width
    return None if out is None else out.logits[:, -1]
