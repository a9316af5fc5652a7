"""Which methods run inside vLLM today, and the one-line refusals. No vLLM import (tested in .venv too).

The engine compacts a request once, right after the forward that completes its prompt (attend, then
evict), with every layer keeping the same number of entries (vLLM's block table is shared by all layers;
each KV head keeps its own entries). So a method runs here when it decides only at the end of the
prompt from keys and values alone:

* `ScoringMethod`s whose schedule evicts only while the prompt is processed (ratio modes: LagKV's
  global mode, KeyDiff, StreamingLLM, KNorm, or any registered one with `compression_ratio=`);
* not: methods that need queries or attention probabilities (SnapKV, H2O, TOVA, ...: they need an
  attention backend that hands them over), scoring passes (KVzip), cross-layer methods (AdaKV), and
  schedules that evict during decoding (budget modes, LagKV's reference mode), which come later;
* `full` keeps everything.
"""

from __future__ import annotations

from functools import lru_cache

from kvtrim.methods import FullCache
from kvtrim.methods.base import EvictionMethod, KvtrimError, ScoringMethod
from kvtrim.specs import parse_method_spec


def refusal(method: EvictionMethod) -> str | None:
    """Why `method` cannot run inside vLLM yet (one line), or None when it can."""
    name = type(method).__name__
    if isinstance(method, FullCache):
        return None
    if method.waits_for_attention:
        return f"{name} needs the queries or attention probabilities, which kvtrim's vLLM worker does not hand over yet"
    if method.scoring_passes or method.cross_layer:
        return f"{name} is not supported inside vLLM yet (scoring passes / cross-layer decisions)"
    if not isinstance(method, ScoringMethod):
        return f"{name} is not supported inside vLLM yet (only ranking methods that decide at the prompt's end)"
    if getattr(method, "skip_layers", ()):
        return f"{name}: skip_layers is not supported inside vLLM (every layer must keep the same number of entries)"
    if getattr(method, "mode", None) == "reference":
        return (f"{name} in reference mode (keep_ratio=) compresses during decoding, which kvtrim's vLLM worker does "
                "not do yet: use compression_ratio=")
    sched = method.schedule()
    if sched.append or sched.decode_slack is not None:
        return (f"{name} with budget= evicts during decoding, which kvtrim's vLLM worker does not do yet: "
                "use compression_ratio=")
    return None


def method_for_vllm(text: str) -> EvictionMethod | None:
    """The method of spec `text` as the engine runs it (None for `full`), or a one-line `KvtrimError`
    (whatever a request sends: `vllm_xargs` values may also be numbers or lists)."""
    if not isinstance(text, str):
        raise KvtrimError(f"the kvtrim method must be a spec string such as 'lagkv:compression_ratio=0.5', got {text!r}")
    return _method(text)


@lru_cache(maxsize=256)
def _method(text: str) -> EvictionMethod | None:
    """Methods are stateless between requests here (each request gets fresh per-layer state from a
    `TrimCache`), so one object per spec text is shared."""
    spec = parse_method_spec(text)
    if spec.is_full:
        return None
    method = spec.build()
    why = refusal(method)
    if why is not None:
        raise KvtrimError(f"{text}: {why}")
    return method
