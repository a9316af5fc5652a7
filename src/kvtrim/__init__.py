"""kvtrim: KV-cache eviction for long-context inference with Hugging Face transformers."""

from kvtrim.attention import disable, enable, is_enabled
from kvtrim.cache import CacheStats, TrimCache, TrimLayer
from kvtrim.prefill import lagkv_chunk_sizes, prefill, prefill_lagkv  # `kvtrim.prefill` is the function
from kvtrim.models import load_model
from kvtrim.generate import generate, generate_text  # `kvtrim.generate` is the function
from kvtrim.compress import CompressedContext, compress  # `kvtrim.compress` is the function
from kvtrim.calibrate import estimate_window, lazy_eviction_preset
from kvtrim.specs import MethodSpec, parse_method_spec
from kvtrim.methods import (
    H2O,
    AdaKV,
    METHODS,
    TOVA,
    EvictionMethod,
    FullCache,
    KeyDiff,
    KNorm,
    KVzip,
    KvtrimError,
    LagKV,
    LayerView,
    LazyEviction,
    Phase,
    Schedule,
    ScoringMethod,
    SnapKV,
    StreamingLLM,
    kept_count,
    lagkv_keep_ratio_for,
    lagkv_stored_length,
    make_method,
    register_method,
)

__version__ = "0.1.0"

__all__ = [
    "load_model", "generate", "generate_text", "compress", "CompressedContext", "prefill", "prefill_lagkv",
    "lagkv_chunk_sizes", "enable", "disable", "is_enabled", "TrimCache", "TrimLayer", "CacheStats",
    "EvictionMethod", "ScoringMethod", "LayerView", "Phase", "Schedule", "kept_count", "METHODS", "make_method",
    "register_method", "MethodSpec", "parse_method_spec", "KvtrimError", "FullCache", "LagKV", "KeyDiff",
    "StreamingLLM", "SnapKV", "H2O", "TOVA", "LazyEviction", "KNorm", "KVzip", "lagkv_keep_ratio_for",
    "lagkv_stored_length", "estimate_window", "lazy_eviction_preset", "AdaKV",
]
