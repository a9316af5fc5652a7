"""`TrimCache(method, prompt_length=n)`: the forward that completes the prompt ends it, and every layer evicts
right after its own attention in that forward, instead of holding its whole prompt until the first decode
step. The kept entries and the generated tokens are those of the deferred end (the reference: the same
cache without `prompt_length`), for every method; `kvtrim.generate` gives its fresh cache the length."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from kvtrim.cache import TrimCache
from kvtrim.methods.base import KvtrimError
from kvtrim.specs import parse_method_spec
from conftest import tiny_model

N, NEW = 96, 6
SPECS = ["lagkv:compression_ratio=0.5:lag_size=16:sink_size=4", "lagkv:lag_size=16:sink_size=4",
         "keydiff:compression_ratio=0.5", "keydiff:budget=40:block_size=16", "snapkv:compression_ratio=0.5:window=8",
         "knorm:compression_ratio=0.75", "streaming:compression_ratio=0.5", "streaming:budget=40", "h2o:budget=40",
         "h2o:compression_ratio=0.5", "tova:budget=40", "tova:compression_ratio=0.5", "lazyeviction:budget=48:window=4", "adakv:method=snapkv:compression_ratio=0.5:window=8"]


@pytest.fixture(scope="module")
def model():
    return kvtrim.enable(tiny_model("llama", layers=3))


def prompt(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (1, N), generator=torch.Generator().manual_seed(5))


def kept(cache: TrimCache) -> list[torch.Tensor]:
    return [layer.kept_positions() for layer in cache.trim_layers()]


@pytest.mark.parametrize("spec", SPECS)
def test_same_tokens_and_kept_entries_as_the_deferred_end(model, spec):
    ids = prompt(model)
    method = parse_method_spec(spec).build()
    runs = []
    for length in (None, N):
        cache = TrimCache(method, config=model.config, prompt_length=length)
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False)
        runs.append((out, kept(cache)))
    (out_ref, kept_ref), (out_new, kept_new) = runs
    assert torch.equal(out_ref, out_new)
    assert len(kept_ref) == len(kept_new) and all(torch.equal(a, b) for a, b in zip(kept_ref, kept_new))


@pytest.mark.parametrize("spec", ["lagkv:compression_ratio=0.5:lag_size=16:sink_size=4", "keydiff:compression_ratio=0.5",
                                  "snapkv:compression_ratio=0.5:window=8", "knorm:compression_ratio=0.75",
                                  "streaming:compression_ratio=0.5"])
def test_every_layer_evicts_inside_the_prompts_forward(model, spec):
    """One-shot methods (sized by a ratio: they act when the prompt ends): after the one forward that carries
    the prompt, each layer already holds what the prompt's end keeps (the deferred cache still holds all N);
    ending the deferred one gives the same entries. (Budget methods already evict inside every prompt
    forward, with or without the length.)"""
    ids = prompt(model)
    method = parse_method_spec(spec).build()
    early, deferred = (TrimCache(method, config=model.config, prompt_length=n) for n in (N, None))
    with torch.no_grad():
        model(ids, cache=early)
        model(ids, cache=deferred)
    assert early.prompt_ended and not deferred.prompt_ended
    assert all(layer.stored == N for layer in deferred.trim_layers())
    deferred.end_prompt()
    for a, b in zip(early.trim_layers(), deferred.trim_layers()):
        assert a.stored == b.stored < N and torch.equal(a.kept_positions(), b.kept_positions())


def test_chunked_prefill_ends_at_the_length(model):
    """Prompt chunks (`prefill_chunk_size`): the chunk that reaches the length ends the prompt, as `kvtrim.prefill`
    declares it: the same kept entries and first token as that declared path."""
    ids = prompt(model)
    method = parse_method_spec("keydiff:budget=40:block_size=16").build()
    cache = TrimCache(method, config=model.config, prompt_length=N)
    out = model.generate(ids, cache=cache, max_new_tokens=1, do_sample=False, prefill_chunk_size=16)
    assert cache.prompt_ended  # by the last chunk, before any decode step
    ref = TrimCache(method, config=model.config)
    logits = kvtrim.prefill(model, ids, ref, chunk_size=16)
    assert torch.equal(out[:, N:], logits.argmax(-1, keepdim=True))
    assert all(torch.equal(a, b) for a, b in zip(kept(cache), kept(ref)))


def test_a_forward_past_the_length_is_a_one_line_error(model):
    cache = TrimCache(parse_method_spec("keydiff:compression_ratio=0.5").build(), prompt_length=N - 10)
    with pytest.raises(KvtrimError, match=f"past the prompt_length={N - 10}") as err, torch.no_grad():
        model(prompt(model), cache=cache)
    assert "\n" not in str(err.value)
    for bad in (0, -3, 2.5, True, "96"):
        with pytest.raises(KvtrimError, match="prompt_length must be a positive number of tokens"):
            TrimCache(prompt_length=bad)


def test_kvtrim_generate_gives_its_cache_the_length(model):
    ids = prompt(model)
    new, cache = kvtrim.generate(model, ids, parse_method_spec("snapkv:compression_ratio=0.5:window=8").build(),
                                 max_new_tokens=NEW)
    assert cache.prompt_length == N and new.shape[-1] == NEW


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("spec", ["snapkv:compression_ratio=0.5:window=8", "adakv:method=snapkv:compression_ratio=0.5:window=8"])
def test_a_deferred_end_keeps_only_the_window_of_queries(model, spec, padded):
    """Until a deferred prompt end, each layer keeps the last `window` queries of the prompt, and only those:
    not a slice that holds the forward's whole `(batch, q_heads, N, head_dim)` queries alive in every layer
    (on Llama-3.1-8B shapes at 32k tokens that was 8 GiB above the cache, measured on an H200)."""
    ids = prompt(model)
    cache = TrimCache(parse_method_spec(spec).build(), config=model.config, padded=padded)
    with torch.no_grad():
        model(ids, cache=cache)
    for layer in cache.trim_layers():
        kept_queries = layer._prompt_queries if isinstance(layer._prompt_queries, list) else [layer._prompt_queries]
        for q in kept_queries:
            assert q.shape[2] == 8
            assert q.untyped_storage().nbytes() == q.numel() * q.element_size()
