"""Method specifications for the benchmark: `NAME[:param=value[:param=value...]]`.

* `lagkv` -> `LagKV.at_budget(int(n * (1 - compression_ratio)), n)` for a prompt of `n` tokens, so every
  method is compared at (about) the same stored size;
* `lagkv:sink_size=4` -> the same, with extra parameters passed to `at_budget`;
* a spec that fixes its own size (`budget=`, `compression_ratio=` or `keep_ratio=`) is built as given
  (`make_method`), independently of the run's compression ratio, e.g. `keydiff:budget=1024` (a budget
  fixed across context lengths) or `lagkv:compression_ratio=0.75:sink_size=4` (kvpress's LagKV);
* `full` is always the plain full cache.
Sequence values use `+` between items (`skip_layers=0+1`), since `,` separates specs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrim.methods import METHODS, make_method, method_params, param_type
from kvtrim.methods.base import EvictionMethod, KvtrimError, check
from kvtrim.methods.full import FullCache

SIZE_PARAMS = ("budget", "compression_ratio", "keep_ratio")


def _convert(kind: type, text: str, where: str):
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind is tuple:
            return tuple(int(x) for x in text.split("+") if x)
        return kind(text)
    except ValueError:
        raise KvtrimError(f"{where}: cannot read '{text}' as {kind.__name__}") from None


@dataclass(frozen=True)
class MethodSpec:
    """One method column of the benchmark."""

    label: str
    name: str
    params: tuple[tuple[str, object], ...] = ()

    @property
    def fixed_size(self) -> bool:
        return any(k in SIZE_PARAMS for k, _ in self.params)

    def build(self, context_length: int, compression_ratio: float) -> EvictionMethod:
        """The method for a prompt of `context_length` tokens (raises `KvtrimError` when impossible)."""
        params = dict(self.params)
        if self.name == FullCache.name:
            return FullCache()
        if self.fixed_size:
            return make_method(self.name, **params)
        budget = int(context_length * (1 - compression_ratio))
        check(budget >= 1, f"{self.label}: compression ratio {compression_ratio} leaves no entry of {context_length}")
        try:
            return METHODS[self.name].at_budget(budget, context_length, **params)
        except NotImplementedError:
            raise KvtrimError(f"{self.label}: method '{self.name}' has no budget form; give it budget= or "
                              "compression_ratio=") from None


def parse_spec(text: str) -> MethodSpec:
    text = text.strip()
    check(bool(text), "empty method spec")
    name, *items = text.split(":")
    check(name in METHODS, f"unknown method '{name}' in '{text}'; known methods: {', '.join(METHODS)}")
    cls = METHODS[name]
    known = {f.name for f in method_params(cls)}
    params = []
    for item in items:
        key, sep, value = item.partition("=")
        check(bool(sep) and bool(key), f"'{text}': expected param=value, got '{item}'")
        key = key.replace("-", "_")
        check(key in known, f"'{text}': method '{name}' has no parameter '{key}'; its parameters: "
                            f"{', '.join(sorted(known)) or 'none'}")
        params.append((key, _convert(param_type(cls, key), value, f"'{text}'")))
    return MethodSpec(text, name, tuple(params))


def parse_methods(text: str) -> list[MethodSpec]:
    """Comma-separated specs; `full` is added first when missing (every ratio is against it)."""
    specs = [parse_spec(t) for t in text.split(",") if t.strip()]
    check(bool(specs), "no method given")
    labels = [s.label for s in specs]
    check(len(set(labels)) == len(labels), f"a method is listed twice: {labels}")
    if FullCache.name not in labels:
        specs.insert(0, parse_spec(FullCache.name))
    return specs
