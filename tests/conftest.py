"""Shared fixtures: tiny random models (unit tests) and the real default model (integration tests)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def tiny_config(kind: str = "llama", layers: int = 2, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                vocab: int = 256):
    common = dict(
        num_hidden_layers=layers, hidden_size=q_heads * head_dim, intermediate_size=4 * q_heads * head_dim,
        num_attention_heads=q_heads, num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=4096,
    )
    return LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)


def tiny_model(kind: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **kwargs):
    """A randomly initialised float32 model with GQA, built in milliseconds, no files."""
    torch.manual_seed(seed)
    cfg = tiny_config(kind, **kwargs)
    cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
    return cls._from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32).eval()


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request):
    """A tiny GQA model of each family (Llama: 4 query / 2 KV heads; Qwen2: 6 / 2, with qkv bias)."""
    if request.param == "llama":
        return tiny_model("llama")
    return tiny_model("qwen2", q_heads=6, kv_heads=2)


@pytest.fixture(scope="session")
def smollm():
    """The real default model (SmolLM2-135M-Instruct, float32) and its tokenizer."""
    from kvtrim import load_model  # the README's spelling, kvtrim.load_model

    return load_model("smollm2-135m", dtype=torch.float32)
