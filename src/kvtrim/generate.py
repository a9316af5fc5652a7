"""A thin helper over `model.generate` with a `TrimCache`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtrim.cache import CacheStats, TrimCache
from kvtrim.methods.base import EvictionMethod
from kvtrim.decoding import pad_token_id
from kvtrim.models import check_fits
from kvtrim.prefill import as_sequences, padded_layout, prefill_padded


@dataclass
class Generation:
    text: str
    new_tokens: torch.Tensor  # (new_len,)
    prompt_tokens: int
    stats: CacheStats


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> torch.Tensor:
    """Token ids `(1, n)` of `prompt`, through the chat template when `chat` and the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        return ids
    return tokenizer(prompt, return_tensors="pt").input_ids


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    method: EvictionMethod | None = None,
    max_new_tokens: int = 32,
    cache: TrimCache | None = None,
    prefill_chunk_size: int | None | str = "auto",
    tokenizer=None,
    **generate_kwargs,
) -> tuple[torch.Tensor, TrimCache]:
    """`model.generate` with a fresh `TrimCache(method, prompt_length=n)` (greedy unless told otherwise): the
    prompt's last forward evicts each layer right after its attention.

    `prefill_chunk_size`: feed the prompt in chunks of this many tokens (None: one forward); "auto"
    uses the method's block size when it has one (KeyDiff), so the prefill's memory stays bounded.
    Methods with scoring passes (KVzip) need the `tokenizer`: all but the last prompt token are
    compressed with `kvtrim.compress`, then generation continues from the last one.
    A padded batch (`attention_mask=` with pads, left padding): each sequence is generated as alone; a
    chunked prefill then gives each sequence its own blocks (`kvtrim.prefill.padded_layout`: all blocks
    but the last through `prefill_padded`, the last by `generate`).
    Returns `(new_token_ids (batch, new_len), cache)`.
    """
    n = input_ids.shape[-1]
    check_fits(model.config, n, max_new_tokens)
    mask = generate_kwargs.pop("attention_mask", None)
    padded = mask is not None and not bool(mask.all())
    if cache is None and method is not None and method.scoring_passes and n >= 2:
        from kvtrim.compress import compress

        ctx = compress(model, input_ids[:, :-1], method, chunk_size=prefill_chunk_size, tokenizer=tokenizer,
                       attention_mask=None if mask is None else mask[:, :-1])
        return ctx.generate(input_ids[:, -1:], max_new_tokens, cache=ctx.cache, **generate_kwargs), ctx.cache
    fresh = cache is None
    cache = cache if cache is not None else TrimCache(method, config=model.config)
    if prefill_chunk_size == "auto":
        prefill_chunk_size = cache.method.prefill_block_size()
    if mask is None:
        mask = torch.ones_like(input_ids)
    if padded and prefill_chunk_size is not None:
        input_ids, mask, widths = padded_layout(as_sequences(input_ids, mask), prefill_chunk_size,
                                                pad_token_id(model) or 0)
        n = input_ids.shape[-1]
    if fresh:  # the prompt is known: each layer evicts right after its attention in the forward that ends it
        cache.prompt_length = n
    if padded and prefill_chunk_size is not None:
        if len(widths) > 1:
            prefill_padded(model, input_ids, mask, widths[:-1], cache, end_prompt=False)
    elif prefill_chunk_size is not None:
        generate_kwargs["prefill_chunk_size"] = prefill_chunk_size
    generate_kwargs.setdefault("do_sample", False)
    out = model.generate(
        input_ids.to(model.device),
        attention_mask=mask.to(model.device),
        cache=cache,
        max_new_tokens=max_new_tokens,
        pad_token_id=generate_kwargs.pop("pad_token_id", None) or pad_token_id(model),
        **generate_kwargs,
    )
    return out[:, n:], cache



def generate_text(
    model,
    tokenizer,
    prompt: str,
    method: EvictionMethod | None = None,
    max_new_tokens: int = 64,
    chat: bool = False,
    **generate_kwargs,
) -> Generation:
    """Generate a completion of `prompt` (batch size 1) and report the cache statistics."""
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    new, cache = generate(model, ids, method, max_new_tokens=max_new_tokens, **generate_kwargs)
    text = tokenizer.decode(new[0], skip_special_tokens=True)
    return Generation(text, new[0], ids.shape[-1], cache.stats())
