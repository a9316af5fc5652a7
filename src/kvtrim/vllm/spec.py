"""Which methods run inside vLLM today, and the one-line refusals. No vLLM import (tested in .venv too).

The engine compacts a request right after a forward that evicts (attend, then evict): the one that
completes its prompt, and, for methods that evict while decoding, the decode steps and appends where they
do (`kvtrim.vllm.compact`), with every layer keeping the same number of entries (vLLM's block table is
shared by all layers; each KV head keeps its own entries). The scheduler frees blocks by counts it works
out before the keys exist, so a method runs here when it decides from keys and values alone and keeps a
number of entries that depends on token counts only:

* `ScoringMethod`s on keys and values: LagKV (global mode `compression_ratio=` at the prompt's end,
  reference mode `keep_ratio=` every `lag_size` tokens, in decoding too), KeyDiff (`compression_ratio=` at
  the prompt's end; `budget=`: the prompt read in blocks of `block_size`, each evicting back to the budget,
  then back to the budget every `block_size` decoded tokens), StreamingLLM, KNorm, or any registered one;
* methods that read queries only where the prompt's blocks end (SnapKV: `compression_ratio=` and `budget=`
  at the prompt's end, `budget=:block_size=` at each block's end): kvtrim's attention backend captures each
  block's last `prompt_queries()` queries (`kvtrim.vllm.attention`);
* TOVA (`budget=`, `compression_ratio=`): the prompt's last query at its end, then each due decode step's
  query, whose attention probabilities over the request's stored entries the compaction computes (an
  append, a recomputed request's tokens after its prompt, hands over its last query: all TOVA reads);
* H2O (every form): the column sums of its prompt's causal attention at its end (`prompt_sums`, its declared
  `prompt_attention_summary = "sums"`: accumulated
  per prefill chunk from the chunk's queries as the chunk is computed, `layers x kv_heads x prompt` floats;
  no prompt query is held), then each decode step's
  probabilities, computed as TOVA's, accumulated in its per-entry scores, which `RequestEntries.states`
  carries from one compaction to the next (a state that changes every step: every step is due);
* LazyEviction (`budget=`, `window=`): the prompt whole, then each decode step's probabilities, computed as
  TOVA's, update its recurrence state (TS/MRI per entry and the step counter), which `RequestEntries.states`
  carries from one compaction to the next (every decode step is due); every `window` steps it evicts back to
  its budget;
* any other method that `needs_attention` (a registered one too) gets the same hand-over: the prompt's last
  `prompt_queries()` queries at its end when it `needs_queries`, each due decode step's probabilities, an
  append's queries;
* not: queries elsewhere (appends' or decode steps' for a ranking method), scoring passes and cross-layer decisions (KVzip), head-wise
  budgets (AdaKV, declared `same_count_per_head = False`: per-head counts, which vLLM's shared block table
  cannot hold) and `skip_layers` (layers keeping different counts);
* `full` keeps everything.

Methods that installed packages register through the `kvtrim.methods` entry points are found here too:
every process of the server (API server, engine, worker) loads them before it reads its first spec.
"""

from __future__ import annotations

import logging
from functools import cache, lru_cache

from kvtrim.methods import FullCache, load_entry_points
from kvtrim.methods.base import EvictionMethod, KvtrimError, ScoringMethod
from kvtrim.specs import parse_method_spec
from kvtrim.vllm import CONTEXT_KEY, REQUEST_KEY


def refusal(method: EvictionMethod) -> str | None:
    """Why `method` cannot run inside vLLM yet (one line), or None when it can."""
    name = type(method).__name__
    if isinstance(method, FullCache):
        return None
    if not method.same_count_per_head:
        return (f"{name} keeps a different number of entries per KV head, which vLLM's block table (one per "
                "request, shared by every head) cannot hold")
    if method.prompt_attention_summary not in (None, "sums"):
        return (f"{name}: prompt_attention_summary {method.prompt_attention_summary!r} is not one kvtrim's vLLM "
                "worker computes (None or 'sums')")
    if method.scoring_passes or method.cross_layer:
        return f"{name} is not supported inside vLLM yet (scoring passes / cross-layer decisions)"
    if method.needs_attention:  # handed each decode step's probabilities (and appends' queries) as in transformers
        if not isinstance(method, ScoringMethod):  # an `EvictionMethod` deciding in `on_attention` (LazyEviction)
            return None
    elif method.needs_queries and not _queries_at_prompt_blocks_only(method):
        return (f"{name} needs queries at appends or decode steps, which kvtrim's vLLM worker hands over only to "
                "methods that need attention")
    if not isinstance(method, ScoringMethod):
        return f"{name} is not supported inside vLLM yet (only ranking methods on keys and values)"
    if getattr(method, "skip_layers", ()):
        return f"{name}: skip_layers is not supported inside vLLM (every layer must keep the same number of entries)"
    return None


def parallel_refusal(method: EvictionMethod | None, tensor_parallel: int) -> str | None:
    """Why `method` cannot run on a server of `tensor_parallel` ranks, each holding some of every layer's KV heads
    and compacting them alone (one line), or None."""
    if tensor_parallel > 1 and method is not None and method.decides_across_heads:
        return (f"{type(method).__name__} decides from all of a layer's heads at once, which tensor parallelism "
                f"splits across {tensor_parallel} ranks: serve it with --tensor-parallel-size 1")
    return None


def request_refusal(method: EvictionMethod | None, context: int | None, prompt_tokens: int,
                    tensor_parallel: int) -> str | None:
    """Why a request of `prompt_tokens` under `method`, naming `context` (None: none), cannot run on a server of
    `tensor_parallel` ranks (one line: `parallel_refusal`, then `context_refusal`), or None. The one rule of the
    server's front end (a 400) and of the scheduler's manager (its guard)."""
    why = parallel_refusal(method, tensor_parallel)
    if why is None and context is not None:
        why = context_refusal(method, context, prompt_tokens)
    return why


def prompt_sums(method: EvictionMethod | None) -> bool:
    """True for a method that reads its prompt's attention as the column sums of its causal attention
    (`prompt_attention_summary = "sums"`; H2O: its accumulated scores start with them): the engine adds each
    prefill chunk's sums as the chunk is computed (`LayerView.attention_sums`) instead of holding every prompt
    query until the prompt ends. False for None (`full`)."""
    return method is not None and method.prompt_attention_summary == "sums"


def reads_prefix_cache(method: EvictionMethod) -> bool:
    """True for a method whose requests may start from cached prompt blocks (vLLM's prefix cache): it compacts
    nothing before its prompt ends (no prefill block), reads no prompt attention sums, and at most its prompt's
    last query (always computed: vLLM recomputes a prompt's last token whatever it finds cached)."""
    return method.prefill_block_size() is None and not prompt_sums(method) and prompt_queries(method) <= 1


def shares_context(method: EvictionMethod | None) -> bool:
    """True for a method whose compressed context (`kvtrim_context`) requests may share read-only, no request
    writing it again: a ranking method that evicts only where its prompt ends (never at appends or decode steps:
    no `append`, no `decode_slack` in its schedule), whose count is not a function of the tokens seen
    (`stored_after`: LagKV's reference mode) or of its decode steps (LazyEviction), and which keeps no per-layer
    state its planner follows: after its context, no compaction of it is ever planned. False for `full`."""
    schedule = method.schedule() if isinstance(method, ScoringMethod) else None
    if schedule is None or schedule.append or schedule.decode_slack is not None:
        return False
    stateful = method.new_state(0) is not None and (method.counts_by_schedule() or method.counts_ignore_attention)
    return method.stored_after(1) is None and not method.counts_by_decode_steps and not stateful


def prompt_queries(method: EvictionMethod) -> int:
    """How many of a prompt (block)'s last queries the engine hands `method` at its end: `prompt_queries()`
    (SnapKV's window, TOVA's last); none for a method given its prompt's sums (`prompt_sums`)."""
    return 0 if prompt_sums(method) else method.prompt_queries()


def _queries_at_prompt_blocks_only(method: EvictionMethod) -> bool:
    """True for a method that reads queries only where a prompt block ends (the block's last `prompt_queries()`,
    which kvtrim's attention backend captures; the prompt is one block unless the method has a
    `prefill_block_size()`): a `ScoringMethod` that evicts only then (SnapKV: `compression_ratio=` at the
    prompt's end, `budget=` after each block), never at appends or decode steps, and observes nothing."""
    schedule = method.schedule() if isinstance(method, ScoringMethod) else None
    return (schedule is not None and not schedule.append and schedule.decode_slack is None
            and type(method).observe is ScoringMethod.observe and method.prompt_queries() > 0)


def method_for_vllm(text: str) -> EvictionMethod | None:
    """The method of spec `text` as the engine runs it (None for `full`), or a one-line `KvtrimError`
    (whatever a request sends: `vllm_xargs` values may also be numbers or lists)."""
    if not isinstance(text, str):
        raise KvtrimError(f"the kvtrim method must be a spec string such as 'lagkv:compression_ratio=0.5', got {text!r}")
    return _method(text)


def request_method(params, default: str) -> EvictionMethod | None:
    """The method a request runs under: its own spec (`vllm_xargs={"kvtrim": SPEC}`, in its sampling parameters'
    `extra_args`) or the server's `default` (one-line `KvtrimError` for a bad one)."""
    extra = getattr(params, "extra_args", None) or {}
    return method_for_vllm(extra.get(REQUEST_KEY, default))


def request_context(params) -> int | None:
    """The request's context length (`vllm_xargs={"kvtrim_context": N}`: its first N prompt tokens are the prompt
    its method compresses, on their own), or None; a one-line `KvtrimError` for a value that is not an integer
    of at least 1."""
    extra = getattr(params, "extra_args", None) or {}
    if CONTEXT_KEY not in extra:
        return None
    n = extra[CONTEXT_KEY]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KvtrimError(f"{CONTEXT_KEY} must be the number of leading prompt tokens to compress as a context, an "
                          f"integer >= 1, got {n!r}")
    return n


def context_refusal(method: EvictionMethod | None, context: int, prompt_tokens: int) -> str | None:
    """Why a request of `prompt_tokens` cannot compress its first `context` tokens on their own under `method`
    (one line), or None."""
    if method is None:
        return f"{CONTEXT_KEY}={context} needs a method that compresses (this request's is full)"
    if context > prompt_tokens:
        return f"{CONTEXT_KEY}={context} is past the prompt's end ({prompt_tokens} tokens)"
    return None


@cache
def _registered() -> None:
    """Installed packages' methods, once per process (a broken entry point is logged under vLLM's logger)."""
    load_entry_points(logging.getLogger("vllm.kvtrim").warning)


@lru_cache(maxsize=256)
def _method(text: str) -> EvictionMethod | None:
    """Methods are stateless between requests here (each request gets fresh per-layer state from a
    `TrimCache`), so one object per spec text is shared."""
    _registered()
    spec = parse_method_spec(text)
    if spec.is_full:
        return None
    method = spec.build()
    why = refusal(method)
    if why is not None:
        raise KvtrimError(f"{text}: {why}")
    return method
