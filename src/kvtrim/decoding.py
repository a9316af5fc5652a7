"""Greedy decoding on a prepared cache: the answer step of `kvtrim eval`, the passkey checks of
`kvtrim bench --vs-kvpress` and the benchmark scripts (neutral ground for both)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from kvtrim.cache import TrimCache
from kvtrim.methods.base import Phase, check
from kvtrim.prefill import layout_positions, prefill


@torch.no_grad()
def forward_last_logits(model, input_ids: torch.Tensor, cache: TrimCache,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of `input_ids` `(batch, m)` after what `cache` holds; logits of the last token `(batch, vocab)`.

    Positions continue from the tokens the cache has *seen* (not stored), as the model would derive them.
    Multi-token inputs go through `kvtrim.prefill.prefill` (one forward), which also refuses caches whose
    layers hold different numbers of entries (one mask per forward would be wrongly sized).

    A padded batch (a cache filled by `kvtrim.compress` from a list of contexts): `attention_mask`
    `(batch, columns so far + m)` is the layout's mask followed by that of `input_ids` (left-padded, so that
    the last column is real in every row); each sequence continues at its own position."""
    if attention_mask is not None:
        m = attention_mask.to(model.device)
        positions = layout_positions(m)[:, -input_ids.shape[-1]:]
        phase = Phase.APPEND if cache.prompt_ended else Phase.PREFILL
        with cache.phase(phase) if input_ids.shape[-1] > 1 else contextlib.nullcontext():  # as `prefill` declares it
            out = model(input_ids=input_ids.to(model.device), attention_mask=m, position_ids=positions, cache=cache,
                        use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]
    if input_ids.shape[-1] > 1:
        return prefill(model, input_ids, cache, chunk_size=input_ids.shape[-1])
    start = cache.get_seq_length()
    m = input_ids.shape[-1]
    positions = torch.arange(start, start + m, device=model.device)[None]
    out = model(input_ids=input_ids.to(model.device), cache=cache, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]


def pad_token_id(model) -> int | None:
    """The model's pad token id, else its (first) end-of-sequence id."""
    cfg = model.generation_config
    eos = cfg.eos_token_id
    return cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)


def eos_ids(model, tokenizer=None) -> set[int]:
    ids = model.generation_config.eos_token_id
    out = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    return out


@torch.no_grad()
def greedy_decode(
    model, cache: TrimCache, logits: torch.Tensor, max_new_tokens: int, stop_ids: set[int],
    done: Callable[[list[int]], bool] | None = None, after_step: Callable[[], None] | None = None,
) -> list[int]:
    """Greedy tokens from `logits` `(1, vocab)` (those of the last prompt token), feeding each token back
    through `model` with `cache`; stops at a token of `stop_ids` (not returned), after `max_new_tokens`,
    or as soon as `done(tokens)` is true. `after_step()` runs after each token's forward (to watch the
    cache during decoding)."""
    tokens: list[int] = []
    for step in range(max_new_tokens):
        token = int(logits[0].argmax())
        if token in stop_ids:
            break
        tokens.append(token)
        if done is not None and done(tokens):
            break
        if step + 1 < max_new_tokens:
            logits = forward_last_logits(model, torch.tensor([[token]]), cache)
            if after_step is not None:
                after_step()
    return tokens


@torch.no_grad()
def greedy_decode_batch(
    model, cache: TrimCache, logits: torch.Tensor, max_new_tokens: list[int], stop_ids: set[int],
    done: list[Callable[[list[int]], bool] | None] | None = None,
    after_step: Callable[[list[int]], None] | None = None,
    finished: Callable[[int], None] | None = None, attention_mask: torch.Tensor | None = None,
) -> list[list[int]]:
    """`greedy_decode` for a batch: row `i` follows exactly the rules of `greedy_decode` with its own
    `max_new_tokens[i]` and `done[i]`, from `logits` `(batch, vocab)`.

    Each step feeds every row's token in one `(batch, 1)` forward while any row still needs it. A row
    that stopped keeps being fed its own greedy token (rows do not attend to each other), but nothing
    of it is returned or watched after it stopped: `finished(i)` runs at the moment row `i` stops
    (before any further forward, to read its cache then), `after_step(rows)` after each forward with
    the rows that forward was for (those that `greedy_decode` would have fed). `attention_mask`: a padded
    batch's mask so far (`forward_last_logits`), extended by one column per step."""
    b = logits.shape[0]
    check(len(max_new_tokens) == b and all(m >= 1 for m in max_new_tokens),
          f"need one max_new_tokens >= 1 per row ({b} rows), got {max_new_tokens}")
    done = done if done is not None else [None] * b
    tokens: list[list[int]] = [[] for _ in range(b)]
    active = list(range(b))
    for step in range(max(max_new_tokens)):
        chosen = logits.argmax(dim=-1)
        fed = []
        for i in active:
            token = int(chosen[i])
            if token not in stop_ids:
                tokens[i].append(token)
                if not (done[i] is not None and done[i](tokens[i])) and step + 1 < max_new_tokens[i]:
                    fed.append(i)
                    continue
            if finished is not None:
                finished(i)
        if not fed:
            break
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(b, 1)], dim=-1)
        logits = forward_last_logits(model, chosen[:, None], cache, attention_mask)
        if after_step is not None:
            after_step(fed)
        active = fed
    return tokens
