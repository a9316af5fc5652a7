"""Method specs of a sweep: `name[:param=value[:param=value...]]`, built per (compression ratio, sample).

How a method is configured for a compression ratio `r` on a context of `n` tokens
(`budget = int(n * (1 - r))` entries per KV head and layer, kvpress's rounding):

* `full`: always `FullCache()`, evaluated once per sample (reported at ratio 0);
* `--compression at-budget` (default): `cls.at_budget(budget, n, **params)` - every method in its own
  reference form, holding about `budget` entries once the context is in the cache (methods may keep
  evicting while decoding, as they are designed to);
* `--compression ratio`: methods with a `compression_ratio` parameter get `compression_ratio=r`
  (kvpress's convention, the LagKV paper's RULER setup: LagKV, StreamingLLM, KeyDiff and SnapKV then
  compress the context once, after the prefill); methods without one fall back to `at_budget`;
* a spec may also place `{ratio}` or `{budget}` in a parameter (`streaming:budget={budget}`,
  `lagkv:compression_ratio={ratio}`): the method is then built directly from its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvtrim.methods import METHODS, method_params, param_type
from kvtrim.methods.base import EvictionMethod, KvtrimError, check
from kvtrim.methods.full import FullCache

COMPRESSION_FORMS = ("at-budget", "ratio")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    params: dict = field(default_factory=dict)  # raw strings, placeholders allowed

    @property
    def label(self) -> str:
        return self.name + "".join(f":{k}={v}" for k, v in self.params.items())

    @property
    def is_full(self) -> bool:
        return self.name == FullCache.name


def parse_method_spec(text: str) -> MethodSpec:
    parts = [p.strip() for p in text.strip().split(":")]
    name = parts[0]
    check(name in METHODS, f"unknown method '{name}'; known methods: {', '.join(METHODS)}")
    known = {f.name for f in method_params(METHODS[name])}
    params: dict[str, str] = {}
    for part in parts[1:]:
        check("=" in part, f"method spec '{text}': expected param=value after ':', got '{part}'")
        key, value = (s.strip() for s in part.split("=", 1))
        check(key in known, f"method '{name}' has no parameter '{key}'; its parameters: {', '.join(sorted(known)) or 'none'}")
        params[key] = value
    spec = MethodSpec(name, params)
    _convert(spec, ratio=0.5, budget=64)  # validate types now, not halfway through a sweep
    return spec


def parse_method_specs(text: str | list[str]) -> list[MethodSpec]:
    items = text if isinstance(text, list) else [t for t in text.split(",") if t.strip()]
    specs = [parse_method_spec(t) for t in items]
    labels = [s.label for s in specs]
    check(len(set(labels)) == len(labels), f"duplicate method specs in {', '.join(labels)}")
    return specs


def _convert(spec: MethodSpec, ratio: float, budget: int) -> tuple[dict, bool]:
    """Typed parameters with placeholders filled, and whether any placeholder was used."""
    cls = METHODS[spec.name]
    out, used = {}, False
    for key, raw in spec.params.items():
        if "{ratio}" in raw or "{budget}" in raw:
            used = True
            raw = raw.replace("{ratio}", repr(ratio)).replace("{budget}", str(budget))
        kind = param_type(cls, key)
        try:
            if kind is bool:
                value = raw.lower() in ("1", "true", "yes", "on")
            elif kind is tuple:
                value = tuple(int(x) for x in raw.replace("/", ",").split(",") if x.strip())
            else:
                value = kind(raw)
        except ValueError:
            raise KvtrimError(f"method '{spec.name}': parameter {key}={raw!r} is not a valid {kind.__name__}") from None
        out[key] = value
    return out, used


def context_budget(context_tokens: int, compression_ratio: float) -> int:
    return int(context_tokens * (1 - compression_ratio))


def build_method(spec: MethodSpec, compression_ratio: float, context_tokens: int,
                 compression: str = "at-budget") -> EvictionMethod:
    """The method of `spec` for one sample (see the module docstring). Raises `KvtrimError` (or
    `NotImplementedError` for a method without a budget form) when it cannot be configured."""
    if spec.is_full:
        return FullCache()
    cls = METHODS[spec.name]
    budget = context_budget(context_tokens, compression_ratio)
    params, direct = _convert(spec, compression_ratio, budget)
    if direct:
        return cls(**params)
    if compression == "ratio" and "compression_ratio" in {f.name for f in fields(cls)}:
        return cls(compression_ratio=compression_ratio, **params)
    return cls.at_budget(budget, context_tokens, **params)
