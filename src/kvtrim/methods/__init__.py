"""Eviction methods and their registry (name -> class)."""

from __future__ import annotations

import dataclasses

from kvtrim.methods.base import (
    EvictionMethod,
    KvtrimError,
    LayerView,
    Phase,
    Schedule,
    ScoringMethod,
    check,
    kept_count,
    param_type,
)
from kvtrim.methods.adakv import AdaKV, adakv_keep
from kvtrim.methods.full import FullCache
from kvtrim.methods.h2o import H2O
from kvtrim.methods.keydiff import KeyDiff
from kvtrim.methods.knorm import KNorm
from kvtrim.methods.kvzip import KVzip
from kvtrim.methods.lagkv import LagKV, lagkv_keep_ratio_for, lagkv_stored_length
from kvtrim.methods.lazy_eviction import LazyEviction
from kvtrim.methods.snapkv import SnapKV
from kvtrim.methods.streaming import StreamingLLM
from kvtrim.methods.tova import TOVA

#: name -> method class; `register_method` adds to it (the CLI, `kvtrim eval` and `kvtrim bench` read it)
METHODS: dict[str, type[EvictionMethod]] = {}
#: the entry point group through which installed packages register methods (each entry point is loaded:
#: importing it calls `register_method`)
ENTRY_POINT_GROUP = "kvtrim.methods"


def load_entry_points(on_error=None) -> None:
    """Load every `kvtrim.methods` entry point (installed packages' methods register themselves). A broken
    one is reported through `on_error(message)` and skipped; without `on_error` it is skipped silently."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as err:  # noqa: BLE001 - a broken third-party plugin must not break kvtrim
            if on_error is not None:
                on_error(f"entry point {ep.name} ({ep.value}) failed to load: {err}")


def register_method(cls: type[EvictionMethod], replace: bool = False) -> type[EvictionMethod]:
    """Make a method class available by its `name` to `make_method`, the CLI, `kvtrim eval` and
    `kvtrim bench`. Usable as a decorator. Returns `cls`.

    The class must be a dataclass subclass of `EvictionMethod` (usually `ScoringMethod`) with a `name`
    made of lowercase letters, digits, `_` or `-`; an existing name is refused unless `replace=True`."""
    check(isinstance(cls, type) and issubclass(cls, EvictionMethod),
          f"register_method expects an EvictionMethod subclass, got {cls!r}")
    check(dataclasses.is_dataclass(cls), f"{cls.__name__} must be a dataclass (decorate it with @dataclass)")
    name = cls.name
    check(isinstance(name, str) and name not in ("", "base") and name.replace("_", "").replace("-", "").isalnum()
          and name == name.lower(), f"{cls.__name__}.name must be a lowercase identifier, got {name!r}")
    check(replace or name not in METHODS or METHODS[name] is cls,
          f"a method named '{name}' is already registered ({METHODS.get(name, type).__name__}); pass replace=True")
    METHODS[name] = cls
    return cls


for _cls in (FullCache, LagKV, StreamingLLM, KeyDiff, SnapKV, H2O, TOVA, LazyEviction, KNorm, KVzip, AdaKV):
    register_method(_cls)


def method_params(cls: type[EvictionMethod]) -> list[dataclasses.Field]:
    """The hyper-parameters of a method class (its dataclass fields)."""
    return list(dataclasses.fields(cls))


def make_method(name: str, **params) -> EvictionMethod:
    """Build the method `name` from keyword parameters, with one-line errors for unknown names."""
    check(isinstance(name, str) and name in METHODS, f"unknown method '{name}'; known methods: {', '.join(METHODS)}")
    cls = METHODS[name]
    known = {f.name for f in method_params(cls)}
    unknown = sorted(set(params) - known)
    check(not unknown, f"method '{name}' has no parameter {', '.join(unknown)}; "
                       f"its parameters: {', '.join(sorted(known)) or 'none'}")
    return cls(**params)


__all__ = [
    "AdaKV", "adakv_keep", "TOVA", "SnapKV", "LazyEviction", "H2O", "KNorm", "KVzip", "METHODS", "EvictionMethod", "ScoringMethod", "LayerView",
    "Phase", "Schedule", "FullCache", "KeyDiff", "KvtrimError", "LagKV", "StreamingLLM", "kept_count",
    "lagkv_keep_ratio_for", "lagkv_stored_length", "make_method", "method_params", "param_type", "register_method",
]
