"""kvtrim: KV-cache eviction for long-context inference with Hugging Face transformers."""

from kvtrim.attention import disable, enable, is_enabled
from kvtrim.cache import CacheStats, TrimCache, TrimLayer
from kvtrim.prefill import lagkv_chunk_sizes, prefill, prefill_lagkv  # `kvtrim.prefill` is the function
from kvtrim.models import load_model
from kvtrim.generate import generate, generate_text  # `kvtrim.generate` is the function
from kvtrim.methods import (
    H2O,
    TOVA,
    LazyEviction,
    SnapKV,
    estimate_window,
    METHODS,
    EvictionMethod,
    FullCache,
    KeyDiff,
    KvtrimError,
    LagKV,
    StreamingLLM,
    lagkv_keep_ratio_for,
    lagkv_stored_length,
    make_method,
)

__version__ = "0.1.0"

__all__ = [
    "load_model",
    "generate",
    "generate_text",
    "is_enabled",
    "estimate_window",
    "enable",
    "disable",
    "TOVA",
    "SnapKV",
    "LazyEviction",
    "H2O",
    "METHODS",
    "CacheStats",
    "EvictionMethod",
    "FullCache",
    "KeyDiff",
    "prefill",
    "prefill_lagkv",
    "lagkv_chunk_sizes",
    "KvtrimError",
    "LagKV",
    "StreamingLLM",
    "TrimCache",
    "TrimLayer",
    "lagkv_keep_ratio_for",
    "lagkv_stored_length",
    "make_method",
]
