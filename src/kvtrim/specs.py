"""The one method-spec syntax: `NAME[:param=value[:param=value...]]`, for every command.

    lagkv                          LagKV with its defaults (or sized by a sweep, see `MethodSpec.build`)
    lagkv:lag_size=64:sink_size=4  parameters after `:`; names as in `kvtrim methods` (`-` or `_`)
    lagkv:skip_layers=0+1          a list: items joined by `+` (`,` separates specs in a list of specs)
    keydiff:budget=1024            a spec that fixes its own size is built as given
    streaming:budget={budget}      placeholders {budget} / {ratio}, filled per run by sweeps
    adakv:method=snapkv:window=16  a wrapper (`cls.wraps`): `method=` names the wrapped method; the other
                                   parameters are the wrapper's own (alpha_safeguard) or the wrapped one's

Values are read by the parameter's declared type (int, float, str, bool: true/false, list of ints).
`kvtrim generate --method`, `kvtrim eval --methods` and `kvtrim bench --methods` all use this parser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtrim.methods import METHODS, FullCache, method_params
from kvtrim.methods.base import EvictionMethod, KvtrimError, check, kept_count, param_type

PLACEHOLDERS = ("{budget}", "{ratio}")
SIZINGS = ("at-budget", "ratio")


def _read(kind: type, text: str, where: str) -> Any:
    """`text` as a value of `kind` (placeholders are kept as text until `build`)."""
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind is tuple:
            return tuple(int(x) for x in text.split("+") if x.strip())
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        return text
    except ValueError:
        name = "list of integers (items joined by +)" if kind is tuple else kind.__name__
        raise KvtrimError(f"{where}: cannot read '{text}' as {name}") from None


@dataclass(frozen=True)
class MethodSpec:
    """One parsed method spec: the registered `name` and its parameters (typed; placeholders as text)."""

    text: str
    name: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """The spec as written (normalised: `_` in names); keys results and report columns."""
        return self.name + "".join(f":{k}={_show(v)}" for k, v in self.params)

    @property
    def cls(self) -> type[EvictionMethod]:
        return METHODS[self.name]

    @property
    def wraps(self) -> str | None:
        """The parameter naming the wrapped method, for a wrapper such as AdaKV; else None."""
        return getattr(self.cls, "wraps", None)

    @property
    def known_params(self) -> set[str]:
        """Parameter names this spec accepts (a wrapper's own and its wrapped method's)."""
        own = {f.name for f in method_params(self.cls)}
        if not self.wraps:
            return own
        inner = dict(self.params).get(self.wraps)
        return (own - {self.wraps}) | ({f.name for f in method_params(METHODS[inner])} if inner in METHODS else set())

    def _parts(self) -> tuple[dict, MethodSpec]:
        """A wrapper's own parameters and the spec of its wrapped method."""
        own_names = {f.name for f in method_params(self.cls)} - {self.wraps}
        params = dict(self.params)
        inner = params.pop(self.wraps)
        own = {k: v for k, v in params.items() if k in own_names}
        check(not any(isinstance(v, str) and any(p in v for p in PLACEHOLDERS) for v in own.values()),
              f"{self.text}: placeholders go to the wrapped method's parameters")
        return own, MethodSpec(self.text, inner, tuple((k, v) for k, v in params.items() if k not in own_names))

    def _wrap(self, method: EvictionMethod, own: dict) -> EvictionMethod:
        try:
            return self.cls(method, **own)
        except KvtrimError as err:
            raise KvtrimError(f"{self.text}: {err}") from None

    @property
    def is_full(self) -> bool:
        return self.name == FullCache.name

    @property
    def fixes_size(self) -> bool:
        """True when the spec gives one of the method's size parameters (it is then built as given)."""
        if self.wraps:
            return self._parts()[1].fixes_size
        return any(k in self.cls.size_params for k, _ in self.params)

    @property
    def has_placeholders(self) -> bool:
        return any(isinstance(v, str) and any(p in v for p in PLACEHOLDERS) for _, v in self.params)

    def with_params(self, **params) -> MethodSpec:
        """This spec with more parameters (already typed); a parameter given twice is an error."""
        twice = sorted(set(params) & {k for k, _ in self.params})
        check(not twice, f"{self.text}: parameter {', '.join(twice)} given twice")
        return MethodSpec(self.text, self.name, self.params + tuple(params.items()))

    def build(self, context_length: int | None = None, compression_ratio: float | None = None,
              sizing: str = "at-budget", budget: int | None = None) -> EvictionMethod:
        """The method this spec names.

        Without a context (`kvtrim generate`): built from its parameters as given. In a sweep, for a
        context of `context_length` tokens at `compression_ratio` (`budget = kept_count(n, r)`):
        * `full`: `FullCache()`;
        * placeholders filled, or a spec that fixes its own size: built as given;
        * `sizing="ratio"` and a method with a `compression_ratio` size: `compression_ratio=r`
          (kvpress's convention: the method compresses the context once);
        * otherwise `cls.at_budget(budget, n, **params)`: each method in its own reference form, holding
          about `budget` entries once the context is in the cache.
        With `budget` (`kvtrim eval --budgets`) instead of a ratio: that many entries, whatever the
        context's length, always in the at-budget form (`sizing` does not apply); a `{ratio}` placeholder
        becomes the prompt's share it removes, `max(0, 1 - budget / context_length)`.
        A wrapper (AdaKV) wraps its method built by these rules, except that a sweep sizes it with
        `budget=` (the scoring form a wrapper shares), not with the method's own `at_budget` form (LagKV's
        is its reference mode, which has no budget to share).
        Raises `KvtrimError` when the method cannot be configured so.
        """
        if self.is_full:
            return FullCache()
        if self.wraps:
            own, inner = self._parts()
            plain = (context_length is None or inner.fixes_size or inner.has_placeholders
                     or (budget is None and sizing == "ratio" and "compression_ratio" in inner.cls.size_params))
            if plain:
                return self._wrap(inner.build(context_length, compression_ratio, sizing, budget=budget), own)
            check("budget" in inner.cls.size_params, f"{self.text}: {inner.name} has no budget= to share")
            if budget is None:
                budget = kept_count(context_length, compression_ratio)
            return self._wrap(inner._construct({**dict(inner.params), "budget": budget}), own)
        params = dict(self.params)
        if context_length is None:
            check(not self.has_placeholders, f"{self.text}: placeholders need a sweep (kvtrim eval / bench)")
            return self._construct(params)
        check(sizing in SIZINGS, f"sizing must be one of {', '.join(SIZINGS)}, got '{sizing}'")
        check((budget is None) != (compression_ratio is None), "give a sweep cell a compression ratio or a budget")
        if budget is not None:
            check(budget >= 1, f"a budget must be >= 1 entry, got {budget}")
            compression_ratio, sizing = max(0.0, 1 - budget / context_length), "at-budget"
        else:
            budget = kept_count(context_length, compression_ratio)
        if self.has_placeholders:
            params = {k: self._fill(k, v, budget, compression_ratio) for k, v in params.items()}
            return self._construct(params)
        if self.fixes_size:
            return self._construct(params)
        if sizing == "ratio" and "compression_ratio" in self.cls.size_params:
            return self._construct({**params, "compression_ratio": compression_ratio})
        try:
            return self.cls.at_budget(budget, context_length, **params)
        except TypeError as err:  # a user's at_budget that does not take these parameters
            raise KvtrimError(f"{self.text}: {err}") from None

    def check_config(self, config) -> None:
        """Refuse a model this spec's method cannot run on (e.g. LagKV skip_layers beyond its layers),
        from the model's config, before any weights load."""
        method = None if self.is_full else self._neutral()
        if self.wraps and method is not None:
            method = method.method
        if method is not None:
            method.check_config(config)

    def validate(self) -> None:
        """Check the parameters by building the method once, before any work: with its own size when the
        spec gives one, else with a neutral one (a huge budget, or a ratio of 0.5). Whether a sweep cell
        can be reached (a ratio at a length) is decided per cell by `build`."""
        if not self.is_full:
            self._neutral()

    def _neutral(self) -> EvictionMethod | None:
        """The method with its own size, or a neutral one (None when only placeholders can size it)."""
        if self.wraps:
            own, inner = self._parts()
            method = inner._neutral()
            return None if method is None else self._wrap(method, own)
        params = {k: v for k, v in self.params if not (isinstance(v, str) and any(p in v for p in PLACEHOLDERS))}
        if not self.fixes_size and not self.has_placeholders:
            if "budget" in self.cls.size_params:
                params["budget"] = 1 << 30
            elif "compression_ratio" in self.cls.size_params:
                params["compression_ratio"] = 0.5
        try:
            return self.cls(**params)
        except TypeError as err:
            raise KvtrimError(f"{self.text}: {err}") from None
        except KvtrimError as err:
            if not self.has_placeholders:  # with placeholders the size only exists per cell
                raise KvtrimError(f"{self.text}: {err}") from None
        return None

    def _construct(self, params: dict) -> EvictionMethod:
        try:
            return self.cls(**params)
        except TypeError as err:
            raise KvtrimError(f"{self.text}: {err}") from None

    def _fill(self, key: str, value: Any, budget: int, ratio: float) -> Any:
        if not isinstance(value, str) or not any(p in value for p in PLACEHOLDERS):
            return value
        text = value.replace("{budget}", str(budget)).replace("{ratio}", repr(ratio))
        return _read(param_type(self.cls, key), text, self.text)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "+".join(str(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_method_spec(text: str) -> MethodSpec:
    """Parse `NAME[:param=value...]`; unknown names, parameters and unreadable or invalid values are
    one-line errors (`MethodSpec.validate`), raised before any work."""
    check(isinstance(text, str) and text.strip() != "", "empty method spec")
    text = text.strip()
    name, *items = (part.strip() for part in text.split(":"))
    check(name in METHODS, f"unknown method '{name}' in '{text}'; known methods: {', '.join(METHODS)}")
    cls = METHODS[name]
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        check(bool(sep) and bool(key), f"'{text}': expected param=value after ':', got '{item}'")
        pairs.append((key, value.strip()))
    known = {f.name: cls for f in method_params(cls)}
    wraps = getattr(cls, "wraps", None)
    if wraps:  # `method=NAME`: the wrapped method's parameters are known too, read by its types
        inner = dict(pairs).get(wraps)
        check(inner is not None, f"'{text}': {name} wraps a method: give {wraps}=NAME (e.g. {name}:{wraps}=snapkv)")
        check(inner in METHODS, f"'{text}': unknown method '{inner}' to wrap; known methods: {', '.join(METHODS)}")
        check(not getattr(METHODS[inner], "wraps", None), f"'{text}': {name} cannot wrap another wrapper ({inner})")
        known = {**{f.name: METHODS[inner] for f in method_params(METHODS[inner])}, **known}
    params: dict[str, Any] = {}
    for key, value in pairs:
        check(key in known, f"'{text}': method '{name}' has no parameter '{key}'; its parameters: "
                            f"{', '.join(sorted(known)) or 'none'}")
        check(key not in params, f"'{text}': parameter '{key}' given twice")
        if key == wraps:
            params[key] = value
            continue
        kind = param_type(known[key], key)
        params[key] = value if any(p in value for p in PLACEHOLDERS) else _read(kind, value, f"'{text}'")
    spec = MethodSpec(text, name, tuple(params.items()))
    spec.validate()
    return spec


def parse_method_specs(text: str | list[str]) -> list[MethodSpec]:
    """A comma-separated list of specs (or a list of spec strings); duplicates are an error."""
    items = text if isinstance(text, list) else [t for t in text.split(",") if t.strip()]
    specs = [parse_method_spec(t) for t in items]
    check(bool(specs), "no method given")
    labels = [s.label for s in specs]
    check(len(set(labels)) == len(labels), f"a method is listed twice in {', '.join(labels)}")
    return specs
