"""The method contract: what every eviction method implements, and what the cache tells it.

A method is a dataclass of hyper-parameters plus pure tensor functions (in its own module). The cache
layer (`kvtrim.cache.TrimLayer`) owns the tensors; a method sees a read-only `LayerView` of one layer and
returns the indices of the stored entries to keep, shaped `(batch, kv_heads, n_keep)` and sorted
ascending along the last dimension, or `None` to keep everything.

**Phases.** The cache tells the method which kind of forward it is in (`view.phase`), so no method ever
infers it from the number of new tokens:

* `Phase.PREFILL`: a forward of the prompt, one-shot or one block of a block-wise prefill.
  `view.prompt_end` is True on the call that completes the prompt: the last block when the caller said
  so (`kvtrim.prefill`, `kvtrim.compress`), otherwise a *deferred* call (`on_prompt_end`) made when the
  prompt is known to be over — at the first decode step under stock `model.generate`, or on
  `cache.end_prompt()`. Both give the next forward the same cache ("attend, then evict").
* `Phase.APPEND`: a multi-token forward after the prompt ended (the question of a query-agnostic prompt,
  a second question, a new chat turn).
* `Phase.DECODE`: one generated token after the prompt.
* `Phase.SCORE`: a scoring pass run by `kvtrim.compress` before the prompt ends (KVzip's context
  reconstruction): it attends to the cache and stores nothing.

**Hooks** (all optional; the cache calls them at these moments only):

* `on_update(view)`: right after this forward's entries were appended, inside `Cache.update` (the
  forward still attends to everything: the layer returns the full tensors and keeps only the subset);
* `on_attention(view)`: after the layer's attention, for methods that declare `needs_queries` or
  `needs_attention` (`view.queries` / `view.attention` are set; reached through kvtrim's attention);
* `on_prompt_end(view)`: the deferred end of the prompt (see above; `view.n_new == 0`; for methods that
  need queries, `view.queries` holds the last `prompt_queries()` queries of the prompt's last forward);
* `new_state(layer_idx)` / `gather_state(state, keep)`: per-layer state, reduced with the kept indices.

**In-place decoding** (`in_place_decode = True`, opt-in per method; `TrimCache(in_place_decode=False)`
turns it off): a dense layer's decode step may instead write its new entry into the slot its previous
step freed, so storage order is no longer position order. Such steps hand the method a view with
`view.in_place` True: order comes from `view.positions` only, and a method that evicts exactly one
entry per row returns `EvictOne(slots)` (the slot leaving, per row) instead of kept indices; the cache
tells the state with `free_state(state, slots)`. `ScoringMethod` does this for its subclasses through
`evicted_slot`; any other number of entries leaving is returned as kept indices in position order.

**Ranking methods** subclass `ScoringMethod` and implement only `score(view)`: the base owns the size
(`budget=` / `compression_ratio=`), the kept-count rounding (`kept_count`), protected sinks and recent
entries, the schedule (`Schedule`) and the tie-stable top-k (`top_indices`).
"""

from __future__ import annotations

import enum
import math
import numbers
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import torch


class KvtrimError(ValueError):
    """A user-facing error with a one-line message (bad parameter, unsupported input)."""


def check(condition: bool, message: str) -> None:
    """Raise `KvtrimError(message)` unless `condition` holds."""
    if not condition:
        raise KvtrimError(message)


def one_line(err: BaseException) -> str:
    """An exception as the one line a user or a log gets: its message's first line, else its type's name."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ---- sizes: one rule each --------------------------------------------------------------------------
def kept_count(n: int, compression_ratio: float) -> int:
    """Entries kept of `n` at `compression_ratio` (fraction removed): `max(1, int(n * (1 - r)))`.

    kvpress's rounding (so kept sets agree with it), never below one entry. The one function used by
    every method, by `kvtrim eval` to size budgets and by `kvtrim bench`."""
    return max(1, int(n * (1 - compression_ratio)))


def check_compression_ratio(value: float) -> None:
    """`compression_ratio` is a fraction of entries removed: in [0, 1)."""
    check(0 <= value < 1, f"compression_ratio must be in [0, 1), got {value}")


# ---- parameter types: checked once, for every method ---------------------------------------------------
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        try:
            _HINTS[cls] = typing.get_type_hints(cls)
        except Exception:  # unresolvable annotations in a user's class: skip type checks, keep its own
            _HINTS[cls] = {}
    return _HINTS[cls]


def _scalar_hint(hint: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); `X` -> (X, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), len(args) < len(typing.get_args(hint))
    return hint, False


def _checked(owner: str, name: str, hint: Any, value: Any) -> Any:
    """`value` converted to the declared type of parameter `name`, or a one-line `KvtrimError`."""
    hint, optional = _scalar_hint(hint)
    if value is None:
        check(optional, f"{owner}: {name} must not be None")
        return None
    base = typing.get_origin(hint) or hint
    where = f"{owner}: {name}"
    if base is bool:
        check(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
    elif base is int:
        check(isinstance(value, numbers.Integral) and not isinstance(value, bool),
              f"{where} must be an integer, got {value!r}")
        return int(value)
    elif base is float:
        check(isinstance(value, numbers.Real) and not isinstance(value, bool), f"{where} must be a number, got {value!r}")
        check(math.isfinite(float(value)), f"{where} must be a finite number, got {value!r}")
        return float(value)
    elif base is str:
        check(isinstance(value, str), f"{where} must be a string, got {value!r}")
    elif base in (tuple, list):
        check(isinstance(value, (tuple, list)), f"{where} must be a list of integers (e.g. (0, 1)), got {value!r}")
        for item in value:
            check(isinstance(item, numbers.Integral) and not isinstance(item, bool),
                  f"{where} must hold integers, got {item!r}")
        return tuple(int(i) for i in value)
    return value


def param_type(cls: type, name: str) -> type:
    """The scalar type of parameter `name` (`int`, `float`, `str`, `bool`, or `tuple` for sequences)."""
    hint, _ = _scalar_hint(_hints(cls).get(name, str))
    base = typing.get_origin(hint) or hint
    return tuple if base in (tuple, list) else base if isinstance(base, type) else str


# ---- what the cache tells a method ---------------------------------------------------------------------
class Phase(str, enum.Enum):
    """The kind of forward a cache layer is in (see the module docstring)."""

    PREFILL = "prefill"
    APPEND = "append"
    DECODE = "decode"
    #: a scoring pass (KVzip's context reconstruction): the forward attends to every stored entry and to
    #: its own tokens, and stores nothing (`seen` does not advance). Only run by `kvtrim.compress` for
    #: methods with `scoring_passes`; their `on_attention` sees it, with the pass's entries appended to
    #: `view.keys` / `view.values` (the last `view.n_new`) and `view.pass_info` set.
    SCORE = "score"


@dataclass(frozen=True, slots=True)
class LayerView:
    """A read-only view of one cache layer, handed to a method's hooks.

    keys, values: `(batch, kv_heads, n, head_dim)`, every stored entry (this forward's included).
    positions: `(batch, kv_heads, n)`, original positions, ascending per head (except `in_place` views).
    seen: tokens this layer has seen (this forward's included). n_new: entries this forward appended.
    prompt_tokens: length of the prompt once it ended (set on the `prompt_end` call), else None.
    state: the method's own per-layer state (the method may mutate it; nothing else does).
    queries: `(batch, q_heads, q_len, head_dim)` post-RoPE (in `on_attention` / `on_prompt_end` of
    methods that need them). attention: `(batch, q_heads, 1, n)` probabilities of a single-token step
    (methods with `needs_attention`). scaling: the softmax scale the layer used.
    attention_sums: `(batch, kv_heads, n)` float32, instead of `queries` on a prompt forward: the column sums of
    the forward's causal attention per KV head (summed over its group), already reduced by the caller (the vLLM
    engine accumulates them across its prefill chunks instead of holding every prompt query; H2O reads them).
    in_place: True in an in-place decode step (see the module docstring): entries are in slot order,
    `positions` are not sorted (order by them, never by index), and evicting exactly one entry per row
    is returned as `EvictOne`.
    valid: None for a dense layer (every entry stored); for a ragged layer (`TrimLayer.is_ragged`) the
    `(batch, kv_heads, n)` bool mask of the stored entries of its padded view (`n` = the longest row;
    entries past a row's length hold filler, positions -1). Methods evicting from ragged layers return
    a keep mask or -1-padded indices (see `TrimLayer.evict`).
    counted_positions: every position this layer ever stored is its token's index (0, 1, 2, ... as fed: no
    custom position ids), so the last `m` tokens appended sit at positions `seen - m` .. `seen - 1`.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    layer_idx: int
    seen: int
    n_new: int
    phase: Phase
    prompt_end: bool
    prompt_tokens: int | None
    state: Any
    queries: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    scaling: float | None = None
    pass_info: Any = None
    attention_sums: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    in_place: bool = False
    counted_positions: bool = False

    @property
    def stored(self) -> int:
        """Entries per row (the longest row of a ragged layer)."""
        return self.keys.shape[-2]

    @property
    def lengths(self) -> torch.Tensor:
        """`(batch, kv_heads)` int64: entries stored per row."""
        if self.valid is not None:
            return self.valid.sum(-1)
        b, h, n = self.keys.shape[:3]
        return torch.full((b, h), n, dtype=torch.long, device=self.keys.device)

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[1]

    def softmax_scale(self) -> float:
        """The scale the layer used, else `head_dim ** -0.5`."""
        return float(self.scaling) if self.scaling is not None else self.keys.shape[-1] ** -0.5

    def require_queries(self, method: str) -> torch.Tensor:
        check(self.queries is not None,
              f"{method} needs the layer's queries: run the model with kvtrim.enable(model)")
        return self.queries


@dataclass(frozen=True, slots=True)
class EvictOne:
    """What a method returns in an `in_place` decode step when exactly one entry per row leaves.

    slots: `(batch, kv_heads)` int64, the storage index (in the view) of the entry leaving each row; the
    cache writes the next step's entry there instead of copying the kept ones."""

    slots: torch.Tensor


@dataclass(frozen=True)
class Schedule:
    """When a `ScoringMethod` evicts (down to its budget).

    prefill: "end" = once, when the prompt ends; "block" = after every prompt forward that holds more
        than the budget (a one-shot prefill is one block) — needs an absolute budget.
    append: multi-token forwards after the prompt evict when over the budget.
    decode_slack: decode steps evict once the layer holds `budget + decode_slack` entries (1 = every
        step over budget); None = decoding never evicts.
    block_size: the prefill chunk the method is designed for (`kvtrim.prefill` and `kvtrim.generate`
        default to it); None = one forward.
    """

    prefill: str = "end"
    append: bool = False
    decode_slack: int | None = None
    block_size: int | None = None


# ---- the base classes -----------------------------------------------------------------------------------
def _rows_of_states(states: list[Any], join) -> Any:
    """`join` applied to each tensor field of dataclass `states` (one new state; their other fields must agree);
    None for stateless methods."""
    first = states[0]
    if first is None:
        check(all(s is None for s in states), "states of one method are all None or none of them")
        return None
    check(hasattr(first, "__dataclass_fields__"),
          f"{type(first).__name__} states are not a dataclass: the method must define stack_states and state_rows")
    joined = {}
    for f in fields(first):
        values = [getattr(s, f.name) for s in states]
        if not any(isinstance(v, torch.Tensor) for v in values):  # None, or a count: the same in every state
            check(all(v == values[0] for v in values),
                  f"{type(first).__name__}.{f.name} differs between the states: they cannot be one batch")
            joined[f.name] = values[0]
        else:
            check(all(isinstance(v, torch.Tensor) for v in values),
                  f"{type(first).__name__}.{f.name} is not a tensor in every state: it cannot be batched by rows")
            joined[f.name] = join(values)
    return type(first)(**joined)


@dataclass(kw_only=True)
class EvictionMethod:
    """Base class of all methods. Subclasses are dataclasses whose fields are the hyper-parameters;
    their types are checked at construction (one-line `KvtrimError`s). What a method needs from its caller is
    declared in the class attributes below (kvtrim's vLLM engine reads them too: `prompt_attention_summary`,
    `same_count_per_head`, ...), never inferred from its class."""

    #: short name used by the CLI and the registry
    name: ClassVar[str] = "base"
    #: one line for `kvtrim methods`
    summary: ClassVar[str] = ""
    #: True when `on_attention` needs the post-RoPE queries (kvtrim's attention function must be enabled)
    needs_queries: ClassVar[bool] = False
    #: True when `on_attention` needs the attention probabilities of decode steps
    needs_attention: ClassVar[bool] = False
    #: the parameters that fix how much the method keeps; a spec giving one is built as given
    size_params: ClassVar[tuple[str, ...]] = ()
    #: True when the method scores the prompt with extra forwards (`scoring_inputs`, `Phase.SCORE`),
    #: which `kvtrim.compress` runs before ending the prompt
    scoring_passes: ClassVar[bool] = False
    #: True when the prompt's compression is decided across layers at once (`select_layers`)
    cross_layer: ClassVar[bool] = False
    #: True when the method's decode steps can run in place (module docstring): its hooks read order from
    #: `view.positions` when `view.in_place`, return `EvictOne` for one entry per row, and `free_state` follows
    in_place_decode: ClassVar[bool] = False
    #: True when the method's decisions read positions and counts only, never keys or values (StreamingLLM):
    #: every layer and KV head then keeps the same positions, and kvtrim's vLLM worker decides once for all
    positions_only: ClassVar[bool] = False
    #: True when, on a decode step handed its attention probabilities, the method reads no key or value (their
    #: shapes only): kvtrim's vLLM worker then reads only the keys the probabilities come from and hands the
    #: method stand-ins (TOVA, H2O, LazyEviction)
    attention_only_decode: ClassVar[bool] = False
    #: False when the method's decisions never read `view.values` (KeyDiff, KNorm, SnapKV, TOVA, H2O,
    #: LazyEviction, StreamingLLM: keys, queries, attention or positions only): kvtrim's vLLM worker then reads
    #: no values for it and moves the kept entries inside the pool (tests/test_conformance.py checks it)
    reads_values: ClassVar[bool] = True
    #: how the method's prompt attention may be summarised for it instead of holding the prompt's last
    #: `prompt_queries()` queries until the prompt ends: "sums", the column sums of the prompt's causal attention
    #: per KV head (H2O: its accumulated scores start with them), which kvtrim's vLLM engine adds up per prefill
    #: chunk and hands over as `view.attention_sums`; None: the queries themselves
    prompt_attention_summary: ClassVar[str | None] = None
    #: False when the method may keep a different number of entries per KV head (AdaKV's head-wise budgets,
    #: stored ragged): kvtrim's vLLM engine refuses it (one block table per request, shared by every head)
    same_count_per_head: ClassVar[bool] = True
    #: True when how many entries the method keeps follows from its decode steps alone (`kept_after_decode`): its
    #: prompt blocks and appends evict nothing, and a decode step's count depends on the entries stored and the
    #: decode steps since the last prompt block or append (LazyEviction): a planner counts it without keys
    counts_by_decode_steps: ClassVar[bool] = False
    #: True when a KV head's kept entries depend on other KV heads' keys, queries or attention (TOVA: one set per
    #: layer, from its attention averaged over all the layer's heads): kvtrim's vLLM engine refuses it under tensor
    #: parallelism, whose ranks each hold some of the heads (tests/test_parallel.py checks every method's claim)
    decides_across_heads: ClassVar[bool] = False

    def __post_init__(self):
        owner = type(self).__name__
        hints = _hints(type(self))
        for f in fields(self):
            if f.name in hints:
                object.__setattr__(self, f.name, _checked(owner, f.name, hints[f.name], getattr(self, f.name)))

    @property
    def waits_for_attention(self) -> bool:
        """True when the layer must wait for kvtrim's attention to hand over queries or probabilities."""
        return self.needs_queries or self.needs_attention

    # ---- hooks -------------------------------------------------------------------------------
    def new_state(self, layer_idx: int) -> Any:
        """Per-layer mutable state; `None` when the method keeps none."""
        return None

    def on_update(self, view: LayerView) -> torch.Tensor | None:
        """After this forward's entries were appended (before attention). Return kept indices or None."""
        return None

    def on_attention(self, view: LayerView) -> torch.Tensor | None:
        """After the layer's attention (methods that need queries or probabilities). Kept indices or None."""
        return None

    def on_prompt_end(self, view: LayerView) -> torch.Tensor | None:
        """The deferred end of the prompt (see the module docstring). Kept indices or None."""
        return None

    def select_layers(self, views: list[LayerView]) -> list[torch.Tensor | None]:
        """Cross-layer methods: kept indices for every evicting layer at the end of the prompt (one view
        per layer, in order); called by `TrimCache.end_prompt` before each layer's `on_prompt_end`."""
        return [None] * len(views)

    def scoring_inputs(self, context_ids: torch.Tensor, tokenizer: Any) -> list[tuple[torch.Tensor, Any]]:
        """Methods with `scoring_passes`: the inputs `(input_ids (batch, r), pass_info)` of the passes
        `kvtrim.compress` runs on the prefilled `context_ids` `(batch, n)` (`Phase.SCORE`)."""
        return []

    def gather_state(self, state: Any, keep: torch.Tensor) -> Any:
        """Return the state after the entries `keep` `(batch, kv_heads, n_keep)` were kept (in-place layers
        put their entries back in position order with it too: `keep` is then any permutation of slots)."""
        return state

    def free_state(self, state: Any, slots: torch.Tensor) -> Any:
        """In-place decoding: return the state after the entries at `slots` `(batch, kv_heads)` left; the
        next step's new entry takes the same slot (per-entry state there must start afresh)."""
        return state

    def stack_states(self, states: list[Any]) -> Any:
        """One state for the batch rows of `states` one after another (each a state of the same method and layer
        shape, batch first: kvtrim's vLLM engine decides many requests' decode steps as one batch). Default: None
        for stateless methods; a dataclass state's tensor fields concatenated on dim 0 (its other fields, such as
        None or a count, must be the same in every state)."""
        return _rows_of_states(states, lambda tensors: torch.cat(tensors, dim=0))

    def state_key(self, state: Any) -> tuple:
        """What the states `stack_states` joins must share, hashable: a dataclass state's fields that are not tensors
        (None, or a count such as LazyEviction's decode steps), and which fields are tensors; () when stateless."""
        if not hasattr(state, "__dataclass_fields__"):
            return ()
        values = ((f.name, getattr(state, f.name)) for f in fields(state))
        return tuple((name, "tensor" if isinstance(value, torch.Tensor) else value) for name, value in values)

    def state_rows(self, state: Any, rows: torch.Tensor) -> Any:
        """The state of batch rows `rows` `(r,)` int64 of `state` (a copy): what `stack_states` joined, taken
        apart again. Default: as `stack_states`, each tensor field's rows selected."""
        return _rows_of_states([state], lambda tensors: tensors[0].index_select(0, rows))

    def prefill_block_size(self) -> int | None:
        """The prefill chunk this method is designed for (None: the prompt in one forward)."""
        return None

    def peak_stored(self, prompt_tokens: int, total_tokens: int) -> int | None:
        """The most entries one layer holds at once after its prompt (inside a decode step's forward, before
        its eviction; what it keeps when the prompt ends if nothing is decoded) when a prompt of
        `prompt_tokens` is read in one forward and tokens are then decoded one per step up to `total_tokens`:
        what a server reserves for a request once its prompt is in (the prompt's own forward holds the
        whole prompt). None when the method cannot say from token counts alone (a caller then assumes
        `total_tokens`)."""
        return None

    def check_config(self, config: Any) -> None:
        """Refuse a model this method cannot run on (a one-line `KvtrimError`); called with the model's
        config when a `TrimCache` is built with `config=` and by the CLI before weights load."""

    def prompt_queries(self) -> int:
        """How many of the prompt's last queries `on_prompt_end` needs (kept until the prompt ends)."""
        return 0

    def evicts_layer(self, layer_idx: int) -> bool:
        """False for layers this method leaves uncompressed (LagKV's `skip_layers`); wrappers ask it."""
        return True

    def stored_after(self, tokens: int) -> int | None:
        """How many entries one layer stores after `tokens` tokens, when that follows from the count alone
        (however the tokens were split into forwards, the prompt's included) and the method's state changes
        only where its count drops; None when it does not (kvtrim's vLLM scheduler then counts by the
        method's `target`, or runs it on stand-in keys)."""
        return None

    def kept_after_decode(self, stored: int, decode_steps: int) -> int | None:
        """Methods with `counts_by_decode_steps`: the entries one layer keeps after its `decode_steps`-th decode step
        since its last prompt block or append, holding `stored` entries with the step's own (None: it keeps them
        all). The one rule: the method's own hooks decide when to evict by it."""
        return None

    def layers_alike(self) -> bool:
        """True when the method decides every layer by one rule from that layer's own keys, values, positions
        and (when it waits for attention) queries and probabilities, each batch row and KV head apart, with a
        per-layer state that either follows token counts only or is kept per batch row: no layer is treated
        apart. kvtrim's vLLM worker then runs a request's layers through it as one batch (one run instead of
        one per layer; the same decisions), each layer a batch row."""
        return False

    @classmethod
    def at_budget(cls, budget: int, context_length: int, **params) -> EvictionMethod:
        """This method configured to hold about `budget` entries per KV head and layer once a prompt of
        `context_length` tokens is in the cache (`budget = kept_count(context_length, compression_ratio)`).
        Sweeps use it to compare methods at equal memory. Default: the `budget=` parameter."""
        clash = sorted(set(params) & set(cls.size_params))
        check(not clash, f"{cls.name}: {', '.join(clash)} fixes the size already; the sweep sizes it by budget")
        check("budget" in cls.size_params, f"{cls.name} has no budget form; give it its own size parameters")
        return cls(budget=budget, **params)

    # ---- description -------------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({inner})"

    def label(self) -> str:
        """Short form for tables: only the parameters that differ from their defaults (floats to 3 digits)."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        shown = [
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v!r}"
            for k, v in self.params().items()
            if v is not None and (k not in defaults or v != defaults[k])
        ]
        return f"{type(self).__name__}({', '.join(shown)})"


@dataclass(kw_only=True)
class ScoringMethod(EvictionMethod):
    """A method that ranks entries: implement `score(view) -> (batch, kv_heads, n)`, higher = keep.

    Exactly one size: `budget=` (entries kept per KV head and layer) or `compression_ratio=` (fraction
    of the prompt removed; the budget becomes `kept_count(prompt_tokens, compression_ratio)` when the
    prompt ends and stays fixed afterwards). The base decides when to evict (`schedule()`), protects the
    entries `protected()` names (they win every tie; when they alone exceed the budget the earliest of
    them win), and keeps the top entries with `top_indices` (ties -> the earlier entry).

    Default schedule: with a budget, every prompt block over budget; with a ratio, once at the end of the
    prompt; appends and decode steps keep everything. Override `schedule()` to evict later too.
    """

    budget: int | None = None
    compression_ratio: float | None = None

    size_params: ClassVar[tuple[str, ...]] = ("budget", "compression_ratio")
    #: True for a method fed attention whose kept counts still follow the base's rule (`target` on the stored
    #: count) whatever the attention says: attention picks which entries stay, never how many (SnapKV, TOVA,
    #: H2O). `peak_stored` is then the base's, and kvtrim's vLLM scheduler counts it without running it.
    counts_ignore_attention: ClassVar[bool] = False
    #: why scores cannot be compared across KV heads, when they cannot (TOVA: one set shared by all heads;
    #: LagKV's global mode: per-partition ranks, the same in every head); head-wise allocation (AdaKV)
    #: refuses such methods with this reason. None: comparable.
    headwise_refusal: ClassVar[str | None] = None

    def __post_init__(self):
        super().__post_init__()
        self.check_size()

    def check_size(self) -> None:
        """Validate the size parameters (default: exactly one of budget= / compression_ratio=)."""
        name = type(self).__name__
        check((self.budget is None) != (self.compression_ratio is None),
              f"{name} needs exactly one of budget= or compression_ratio=")
        if self.budget is not None:
            check(self.budget >= 1, f"{name}: budget must be >= 1, got {self.budget}")
        else:
            check_compression_ratio(self.compression_ratio)

    # ---- what a subclass implements ------------------------------------------------------------
    def score(self, view: LayerView) -> torch.Tensor | None:
        """`(batch, kv_heads, n)` scores of every stored entry (higher = keep), or None to keep all."""
        raise NotImplementedError

    def schedule(self) -> Schedule:
        return Schedule(prefill="block" if self.budget is not None else "end")

    def observe(self, view: LayerView) -> None:
        """Called at every forward before any eviction decision (e.g. to accumulate attention)."""

    def protected(self, view: LayerView, n_keep: int) -> tuple[int, int]:
        """`(first, last)`: how many of the oldest and of the newest entries are always kept."""
        return 0, 0

    def select(self, view: LayerView, scores: torch.Tensor, n_keep: int) -> torch.Tensor:
        """Indices `(batch, kv_heads, n_keep)` of the kept entries, sorted ascending."""
        first, last = self.protected(view, n_keep)
        return keep_top(scores, n_keep, first, last)

    def fixed_budget(self) -> int | None:
        """The absolute budget, when the method has one before the prompt ends."""
        return self.budget

    # ---- the shared machinery ------------------------------------------------------------------
    def target(self, view: LayerView) -> int | None:
        """How many entries to keep after this call, or None when no eviction is due."""
        sched = self.schedule()
        budget = self.fixed_budget()
        if budget is None and view.prompt_tokens is not None:
            budget = kept_count(view.prompt_tokens, self.compression_ratio)
        if budget is None or view.phase is Phase.SCORE:
            return None
        if view.phase is Phase.PREFILL:
            return budget if view.prompt_end or sched.prefill == "block" else None
        if view.phase is Phase.APPEND:
            return budget if sched.append else None
        due = sched.decode_slack is not None and view.stored >= budget + sched.decode_slack
        return budget if due else None

    def evicted_slot(self, view: LayerView, scores: torch.Tensor, n_keep: int) -> torch.Tensor:
        """In-place decode steps (`view.in_place`, `view.stored == n_keep + 1`): `(batch, kv_heads)` the slot
        of the one entry `select` would drop from each row, read in position order. Default: `keep_top`'s
        rule (protected entries by position rank, then the lowest score, ties -> the latest position).
        Subclasses that override `select` and opt into `in_place_decode` override this too."""
        first, last = self.protected(view, n_keep)
        return lowest_slot(scores, view.positions, first, last)

    def evict_if_due(self, view: LayerView) -> torch.Tensor | EvictOne | None:
        n_keep = self.target(view)
        if n_keep is None or view.stored <= n_keep:
            return None
        scores = self.score(view)
        if scores is None:
            return None
        if not view.in_place:
            return self.select(view, scores, n_keep)
        if view.stored == n_keep + 1:
            return EvictOne(self.evicted_slot(view, scores, n_keep))
        # more than one leaves: `select` on the scores in position order (for selections that read only the
        # scores and the sizes), mapped back to slots, kept in position order
        order = view.positions.argsort(dim=-1)
        return order.gather(-1, self.select(view, scores.gather(-1, order), n_keep))

    def on_update(self, view):
        if self.waits_for_attention:
            return None
        self.observe(view)
        return self.evict_if_due(view)

    def on_attention(self, view):
        self.observe(view)
        return self.evict_if_due(view)

    def on_prompt_end(self, view):
        return self.evict_if_due(view)

    def prefill_block_size(self) -> int | None:
        return self.schedule().block_size

    def peak_stored(self, prompt_tokens: int, total_tokens: int) -> int | None:
        # the base's rule (`target`): the prompt ends at its budget; decoding grows the layer to
        # `budget + decode_slack` before it evicts, or to the end when decoding never evicts. A subclass
        # that decides when to evict itself (its own `target` / hooks) says nothing (`counts_by_schedule`),
        # unless it says it follows the rule (`counts_ignore_attention`: SnapKV, TOVA, H2O; checked against a
        # run with attention in tests/test_peak_stored.py).
        if not (self.counts_by_schedule() or self.counts_ignore_attention):
            return None
        return self._scheduled_peak(prompt_tokens, total_tokens)

    def counts_by_schedule(self) -> bool:
        """True when how many entries this method keeps after each forward follows from token counts by the
        base's rule alone (`target` on the stored count), so a planner may count without keys: none of the
        base's hooks, its budget or its (absent) per-layer state is the subclass's own, no attention is fed
        to it, and its `score` never declines (returns None)."""
        own = ("target", "evict_if_due", "on_update", "on_prompt_end", "fixed_budget", "observe", "new_state")
        return not self.waits_for_attention and all(getattr(type(self), name) is getattr(ScoringMethod, name)
                                                    for name in own)

    def _scheduled_peak(self, prompt_tokens: int, total_tokens: int, budget: int | None = None) -> int:
        """`peak_stored` by the base's rule (for subclasses whose hooks end in it; `budget`: the one their
        own sizing gives, default the base's)."""
        if budget is None:
            budget = self.budget if self.budget is not None else kept_count(prompt_tokens, self.compression_ratio)
        after_prompt = min(prompt_tokens, budget)
        slack = self.schedule().decode_slack
        grown = after_prompt + total_tokens - prompt_tokens
        return grown if slack is None else min(grown, budget + slack)


# ---- shared selection helpers -----------------------------------------------------------------------
def span(start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    """`arange(start, stop)` broadcast to `(batch, kv_heads, stop - start)` of `like` `(batch, kv_heads, ...)`."""
    b, h = like.shape[:2]
    return torch.arange(start, stop, device=like.device).expand(b, h, stop - start)


def lowest_slot(scores: torch.Tensor, positions: torch.Tensor, first: int = 0, last: int = 0,
                last_from: int | None = None) -> torch.Tensor:
    """The entry `keep_top(.., n - 1, first, last)` drops, for entries in any storage order.

    Args:
        scores: `(..., n)`; positions: `(..., n)` distinct per row, giving the order (the first `first` and
            last `last` by position are protected).
        last_from: when the caller knows that the last `last` by position are exactly those at positions
            `>= last_from` in every row (H2O: its recent window always holds the last tokens appended, at
            counted positions), one comparison replaces the `kthvalue` that finds them (the costliest
            operation here: 28 of 70 us per layer and decode step on SmolLM2 at 509 entries, measured by
            `benchmarks/costfloor/h2o_ops.py`).
    Returns:
        `(...)` int64 index of the lowest score among the unprotected entries, ties -> the latest position
        (top-k's ties go to the earlier entry); all protected: the latest of them.
    """
    n = positions.shape[-1]
    protect = None  # (one comparison per protected end: this runs once per layer and decode step)
    if first:
        protect = positions <= positions.kthvalue(min(first, n), dim=-1, keepdim=True).values
    if last:
        if last_from is not None:
            newest = positions >= last_from
        elif last < n:
            newest = positions > positions.kthvalue(n - last, dim=-1, keepdim=True).values
        else:
            newest = torch.ones_like(positions, dtype=torch.bool)
        protect = newest if protect is None else protect | newest
    if protect is not None:
        scores = scores.float().masked_fill(protect, torch.inf)
    low = scores.amin(dim=-1, keepdim=True)
    return positions.masked_fill(scores != low, -1).argmax(dim=-1)


def keep_top(scores: torch.Tensor, n_keep: int, first: int = 0, last: int = 0) -> torch.Tensor:
    """The `n_keep` best of `scores` `(..., n)` with the first `first` and last `last` entries protected:
    protected entries win every tie with the rest; when they alone exceed `n_keep`, the earliest win.
    Returns indices `(..., n_keep)` sorted ascending."""
    if first or last:
        n = scores.shape[-1]
        idx = torch.arange(n, device=scores.device)
        scores = scores.float().masked_fill((idx < first) | (idx >= n - last), torch.inf)
    return top_indices(scores, n_keep)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` highest `scores` along the last dim, sorted ascending; ties go to the earlier
    entry (deterministic, unlike `torch.topk`). Same result as a stable descending sort cut at `k`.

    On CPU, first `_top_without_ties` (a threshold read off by `nonzero`: three operations; measured
    faster than the sort at every size, 2-6x at 1k entries, and about 2x faster than
    `_top_by_threshold` at 1k-4k); when scores tie at the threshold, and on other devices: a stable
    sort below about a thousand entries, `_top_by_threshold` from there.
    """
    n = scores.shape[-1]
    if k >= n:
        return torch.arange(n, device=scores.device).expand_as(scores)
    if scores.device.type == "cpu":
        found = _top_without_ties(scores, k)
        if found is not None:
            return found
    return _top_by_sort(scores, k) if n < 1024 else _top_by_threshold(scores, k)


def _top_without_ties(scores: torch.Tensor, k: int) -> torch.Tensor | None:
    """`top_indices` when no entry outside the top `k` equals the `k`-th best (else None): then exactly
    `k` entries per row lie above the `(n - k)`-th smallest score, and `nonzero` lists them in order.
    (A row never has more than `k` above it, so `k` per row on average means `k` in every row.)
    `nonzero` waits for the device: this is the CPU path."""
    n = scores.shape[-1]
    threshold = scores.kthvalue(n - k, dim=-1, keepdim=True).values
    above = (scores > threshold).nonzero()
    if above.shape[0] != scores.numel() // n * k:
        return None
    return above[:, -1].view(*scores.shape[:-1], k)


def _top_by_sort(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_indices` by a stable descending sort (the definition; fastest below ~1k entries on GPU)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k].sort(dim=-1).values


def _top_by_threshold(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_indices` by threshold: one `kthvalue`, then the entries above it plus the earliest of those
    equal to it, scattered in order into `k` slots (O(n), sync-free on GPU, ties handled)."""
    n = scores.shape[-1]
    threshold = scores.kthvalue(n - k, dim=-1, keepdim=True).values  # everything above it is kept
    above = scores > threshold
    tied = scores == threshold
    missing = k - above.sum(dim=-1, keepdim=True)  # how many of the tied entries make the cut
    keep = above | (tied & (tied.cumsum(dim=-1) <= missing))
    # scatter kept positions, in order, into k slots (slot k collects the rest and is dropped)
    positions = torch.arange(n, device=scores.device).expand_as(scores)
    slot = (keep.cumsum(dim=-1) - 1).masked_fill(~keep, k)
    out = torch.empty(*scores.shape[:-1], k + 1, dtype=torch.long, device=scores.device)
    return out.scatter_(-1, slot, positions)[..., :k]
