"""Eviction methods and their registry (name -> class)."""

from __future__ import annotations

import dataclasses
import types
import typing

from kvtrim.methods.base import EvictionMethod, KvtrimError
from kvtrim.methods.full import FullCache
from kvtrim.methods.h2o import H2O
from kvtrim.methods.keydiff import KeyDiff
from kvtrim.methods.lagkv import LagKV, lagkv_keep_ratio_for, lagkv_stored_length
from kvtrim.methods.lazy_eviction import LazyEviction, estimate_window
from kvtrim.methods.snapkv import SnapKV
from kvtrim.methods.streaming import StreamingLLM
from kvtrim.methods.tova import TOVA

METHODS: dict[str, type[EvictionMethod]] = {cls.name: cls for cls in (FullCache, LagKV, StreamingLLM)}
METHODS[KeyDiff.name] = KeyDiff

for _cls in (SnapKV, H2O, TOVA, LazyEviction):  # attention-based methods (need kvtrim.enable(model))
    METHODS[_cls.name] = _cls


def method_params(cls: type[EvictionMethod]) -> list[dataclasses.Field]:
    """The hyper-parameters of a method class (its dataclass fields)."""
    return list(dataclasses.fields(cls))


def param_type(cls: type[EvictionMethod], name: str) -> type:
    """The scalar type of parameter `name` (`int`, `float`, `str`, `bool`, or `tuple` for sequences)."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # `X | None`
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    base = typing.get_origin(hint) or hint
    return tuple if base in (tuple, list) else base


def make_method(name: str, **params) -> EvictionMethod:
    """Build the method `name` from keyword parameters, with one-line errors for unknown names."""
    if name not in METHODS:
        raise KvtrimError(f"unknown method '{name}'; known methods: {', '.join(METHODS)}")
    cls = METHODS[name]
    known = {f.name for f in method_params(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise KvtrimError(
            f"method '{name}' has no parameter {', '.join(unknown)}; its parameters: {', '.join(sorted(known)) or 'none'}"
        )
    return cls(**params)


__all__ = [
    "estimate_window",
    "TOVA",
    "SnapKV",
    "LazyEviction",
    "H2O",
    "METHODS",
    "EvictionMethod",
    "FullCache",
    "KeyDiff",
    "KvtrimError",
    "LagKV",
    "StreamingLLM",
    "lagkv_keep_ratio_for",
    "lagkv_stored_length",
    "make_method",
    "method_params",
    "param_type",
]
