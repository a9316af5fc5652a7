"""The benchmark loop: per method and context length, prefill time (and its eviction part), decode speed,
stored bytes and peak memory, interleaved so that machine noise hits every method alike.

Each evicting cell also decodes the same number of tokens with a full cache that holds, layer by layer,
as many entries as the method's cache held after the prompt (`same_size_full_cache`): the physical
limit of a cache of that size, measured right after the method in the same cell, so the ratio of the
two steps shows what the eviction bookkeeping costs above it.

Order: for each repeat, for each length, every method once (the method order rotates by one each
repeat). One warm-up cell per method runs first and is discarded.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from kvtrim.bench.memory import PeakMemory
from kvtrim.bench.paths import path_peaks
from kvtrim.specs import MethodSpec, parse_method_spec, parse_method_specs
from kvtrim.bench.timing import EvictionTimer
from kvtrim.cache import TrimCache, TrimLayer
from kvtrim.compress import run_scoring_passes
from kvtrim.methods.base import EvictionMethod, KvtrimError, Phase, check
from kvtrim.methods.full import FullCache
from kvtrim.methods.lagkv import LagKV
from kvtrim.prefill import lagkv_chunk_sizes, prefill

SCHEMA = "kvtrim.bench/1"


@dataclass
class BenchConfig:
    """What to measure. `lengths` are prompt lengths in tokens (clipped to fit the model's context)."""

    model: str = "smollm2-135m"
    methods: list[MethodSpec] = field(default_factory=list)
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    compression_ratio: float = 0.75
    new_tokens: int = 32
    repeats: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    warmup: bool = True
    trace_length: int = 4096  # 0 = no stored-bytes trace
    trace_decode: int = 256
    seed: int = 0
    threads: int | None = None
    max_context: int | None = None  # raise the model's configured context (timing beyond it; see gpu.sh)
    collect_garbage: bool = True  # gc.collect() before each measured block (cheap after gc.freeze())
    time_budget_s: float | None = None  # start no new repeat (and no trace) that would likely end past this
    same_size_decode: bool = True  # also decode with a full cache of each method's stored size (the physical limit)
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # sequences per cell (distinct, equal-length prompts)
    path_memory: bool = True  # first repeat, smallest batch: tensor peak on each user path (`kvtrim.bench.paths`)

    def validate(self) -> None:
        check(bool(self.methods), "no method to benchmark")
        check(bool(self.lengths) and all(n >= 8 for n in self.lengths), f"lengths must be >= 8, got {self.lengths}")
        check(0 <= self.compression_ratio < 1, f"--compression-ratio must be in [0, 1), got {self.compression_ratio}")
        check(self.new_tokens >= 1, f"--new-tokens must be >= 1, got {self.new_tokens}")
        check(self.repeats >= 1, f"--repeats must be >= 1, got {self.repeats}")
        check(self.trace_length >= 0 and self.trace_decode >= 0, "trace sizes must be >= 0")
        check(self.threads is None or self.threads >= 1, f"--threads must be >= 1, got {self.threads}")
        check(self.time_budget_s is None or (math.isfinite(self.time_budget_s) and self.time_budget_s > 0),
              f"--time-budget must be a positive number of seconds, got {self.time_budget_s}")
        check(self.max_context is None or self.max_context >= 1, f"--max-context must be >= 1, got {self.max_context}")
        check(isinstance(self.batch_sizes, list) and bool(self.batch_sizes)
              and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.batch_sizes),
              f"--batch-sizes must be integers >= 1, got {self.batch_sizes}")
        check(len(set(self.batch_sizes)) == len(self.batch_sizes), f"--batch-sizes has duplicates: {self.batch_sizes}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["methods"] = [m.label for m in self.methods]
        return d


def bench_methods(text: str | list[str]) -> list[MethodSpec]:
    """The benchmark's method columns: the specs given, with `full` first when missing (every ratio and
    speed-up is against it)."""
    specs = parse_method_specs(text)
    if not any(spec.is_full for spec in specs):
        specs.insert(0, parse_method_spec("full"))
    return specs


# ---- helpers ------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def prompt_ids(tokenizer, n_tokens: int, seed: int = 0, vocab_size: int | None = None) -> torch.Tensor:
    """`(1, ~n_tokens)` prompt ids: a passkey prompt (needle in the middle) sized in the model's tokens,
    or seeded random ids when there is no tokenizer (random-weight models)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed + n_tokens)
        return torch.randint(0, vocab_size or 1000, (1, n_tokens), generator=gen)
    from kvtrim.passkey import passkey_samples

    sample = passkey_samples(tokenizer, n_tokens, 1, seed=seed)[0]
    ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
    return ids[:, :n_tokens]


def batch_prompt_ids(first: torch.Tensor, tokenizer, batch: int, seed: int = 0,
                     vocab_size: int | None = None) -> torch.Tensor:
    """`(batch, n)`: `first` `(1, n)` and `batch - 1` other prompts of the same kind (seeds `seed + i`),
    all cut to the shortest one's length (an unpadded batch: the cache stores every sequence alike)."""
    if batch == 1:
        return first
    n = first.shape[-1]
    rows = [first] + [prompt_ids(tokenizer, n, seed + i, vocab_size) for i in range(1, batch)]
    n = min(r.shape[-1] for r in rows)
    return torch.cat([r[:, :n] for r in rows], dim=0)


def fitted_length(model, n_tokens: int, new_tokens: int) -> int:
    """Prompt length that leaves room for `new_tokens` (+1 for the token read off the prefill)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    return n_tokens if not limit else min(n_tokens, limit - new_tokens - 1)


def prefill_schedule(method: EvictionMethod, n: int) -> tuple[list[int], str]:
    """How the benchmark feeds a prompt of `n` tokens: the method's own block size when it has one
    (KeyDiff budget mode: the paper's block-wise prefill), else one forward."""
    size = method.prefill_block_size()
    if size is None or size >= n:
        return [n], "one-shot"
    return [min(size, n - s) for s in range(0, n, size)], f"blocks of {size}"


def trace_schedule(method: EvictionMethod, n: int) -> tuple[list[int], str]:
    """Feeding for the stored-bytes trace: as in the benchmark, except LagKV's reference mode, which is
    fed chunk by chunk (paper section 4.3) so that its staircase shows during the prompt too."""
    if isinstance(method, LagKV) and method.mode == "reference":
        return lagkv_chunk_sizes(n, method.sink_size, method.lag_size), "lagkv chunks"
    return prefill_schedule(method, n)


@torch.no_grad()
def decode(model, cache: TrimCache, logits: torch.Tensor, n_tokens: int,
           each_step: Callable[[], None] | None = None) -> torch.Tensor:
    """Greedy decode `n_tokens` forwards after a prefill whose last logits are `logits` `(batch, vocab)`.
    Returns the generated ids `(batch, n_tokens + 1)` (the first one comes from the prefill logits)."""
    token = logits.argmax(-1, keepdim=True)
    out = [token]
    b = token.shape[0]
    for _ in range(n_tokens):
        pos = cache.get_seq_length()
        positions = torch.full((b, 1), pos, dtype=torch.long, device=token.device)
        logits = model(input_ids=token, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        if each_step is not None:
            each_step()
    return torch.cat(out, dim=-1)


def _feed(model, ids: torch.Tensor, cache: TrimCache, sizes: list[int],
          each_chunk: Callable[[], None] | None = None, end_prompt: bool = True) -> torch.Tensor:
    if each_chunk is None:
        return prefill(model, ids, cache, chunk_sizes=sizes, end_prompt=end_prompt)
    offset, logits = 0, None
    for size in sizes:
        offset += size
        logits = prefill(model, ids[:, offset - size : offset], cache, end_prompt=end_prompt and offset == ids.shape[-1])
        each_chunk()
    return logits


def scoring_passes(method: EvictionMethod, ids: torch.Tensor, tokenizer) -> list:
    """The method's scoring passes on `ids` (`[]` for methods without); a KvtrimError when it cannot
    build them (KVzip without a tokenizer: random-weight `arch:` models)."""
    return method.scoring_inputs(ids, tokenizer) if method.scoring_passes else []


def _layer_entry_bytes(layer) -> int:
    if isinstance(layer, TrimLayer):
        return layer.entry_bytes()
    if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
        return 0
    b, h, _, d = layer.keys.shape
    return b * h * (d * layer.keys.element_size() + layer.values.shape[-1] * layer.values.element_size())


def kv_peak_layer_sum(cache: TrimCache) -> int:
    """Sum over layers of each layer's own peak entries (`TrimLayer.peak`) times its entry size: the KV
    memory bound an engine would have to reserve (layers peak at different moments)."""
    total = 0
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            n = layer.peak if isinstance(layer, TrimLayer) else layer.keys.shape[-2]
            total += n * _layer_entry_bytes(layer)
    return total


def stored_shapes(cache: TrimCache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Layer index -> empty-storage stand-ins (`(b, h, n, d)` meta tensors) of the keys and values each
    layer of `cache` holds now: enough to rebuild a cache of the same size later (a ragged layer: a dense
    one of its mean row length, `TrimLayer.dense_shape`)."""
    out = {}
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, TrimLayer) and layer.is_ragged:
            meta = torch.empty(layer.dense_shape(), dtype=layer.storage.dtype, device="meta")
            out[idx] = (meta, meta)
        elif getattr(layer, "is_initialized", False) and layer.keys is not None:
            out[idx] = (layer.keys.to("meta"), layer.values.to("meta"))
    return out


def untimed_copy(cache: TrimCache, method: EvictionMethod, timer: EvictionTimer) -> TrimCache:
    """An independent copy of `cache` (after its prompt) that runs `method` itself, without `timer`'s
    wrappers: the timer is detached for the copy and attached again to `cache`."""
    timer.detach()
    try:
        twin = cache.copy()
    finally:
        timer.attach(cache)
    twin.method = method
    for layer in twin.trim_layers():
        layer.method = method
    return twin


def same_size_full_cache(model, shapes: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> TrimCache:
    """A full cache (`FullCache`, nothing evicted) holding in every layer as many entries as `shapes`
    (from `stored_shapes`) say, in the model's device and the stored dtype (zeros: a decode step's cost
    does not depend on the values). Its prompt has ended, so the next forward is a decode step."""
    device = model_device(model)
    full = TrimCache(FullCache(), config=model.config)
    with full.phase(Phase.PREFILL, ends_prompt=True):
        for idx, (keys, values) in shapes.items():
            full.update(torch.zeros(keys.shape, dtype=keys.dtype, device=device),
                        torch.zeros(values.shape, dtype=values.dtype, device=device), idx)
    return full


@torch.no_grad()
def time_decode(model, cache: TrimCache, logits: torch.Tensor, n_tokens: int) -> float:
    """Seconds to decode `n_tokens` greedily into `cache` after `logits` (synchronised on CUDA)."""
    device = model_device(model)
    _sync(device)
    t0 = time.perf_counter()
    decode(model, cache, logits, n_tokens)
    _sync(device)
    return time.perf_counter() - t0


# ---- one measurement ----------------------------------------------------------------------------
def measure_cell(model, spec: MethodSpec, ids: torch.Tensor, config: BenchConfig, length: int,
                 repeat: int = 0, order: int = 0, return_cache: bool = False, tokenizer=None,
                 paths: bool = False):
    """Measure one (method, prompt) cell. Returns a raw row (and the cache when `return_cache`).

    Methods with scoring passes (KVzip) run them between the prompt's forwards and the end of the
    prompt (`run_scoring_passes`, as `kvtrim.compress` does): `scoring_s` is their wall time, apart from
    `prefill_s` (the prompt's forwards and the selection at the prompt's end); the method's hooks during
    the passes are in `scoring_evict_s`, inside `scoring_s`. `tokenizer` builds the passes' inputs."""
    device = model_device(model)
    n = ids.shape[-1]
    row = {"method": spec.label, "length": length, "prompt_tokens": n, "batch": ids.shape[0], "repeat": repeat,
           "order": order}
    try:
        method = spec.build(n, config.compression_ratio)
        passes = scoring_passes(method, ids, tokenizer)
    except KvtrimError as err:
        row.update(status="skipped", reason=str(err))
        return (row, None) if return_cache else row
    row["method_repr"] = method.describe()
    sizes, schedule = prefill_schedule(method, n)
    row["prefill_schedule"] = schedule
    timer = EvictionTimer(device)
    cache = timer.attach(TrimCache(timer.instrument(method), config=model.config))
    ids = ids.to(device)

    with PeakMemory(device, collect=config.collect_garbage) as mem_prefill:
        _sync(device)
        t0 = time.perf_counter()
        logits = _feed(model, ids, cache, sizes, end_prompt=not passes)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        timer.phase = "scoring"
        scoring_s = run_scoring_passes(model, cache, passes)
        timer.phase = "prefill"
        if passes:
            t0 = time.perf_counter()
            cache.end_prompt()
            _sync(device)
            prefill_s += time.perf_counter() - t0
    stats_prefill = cache.stats()
    shapes = stored_shapes(cache)  # for the physical limit, decoded after the method (outside its memory readings)
    same_size = config.same_size_decode and not isinstance(method, FullCache)
    # the method's step against the physical limit is timed on a copy of its cache without the eviction
    # timer: the timer's own wrappers cost 2-4 % of an H2O / TOVA decode step on CPU (measured), which
    # would count against the method; the timed decode below gives the eviction shares and memory
    untimed_s = time_decode(model, untimed_copy(cache, method, timer), logits, config.new_tokens) if same_size else None
    timer.phase = "decode"
    with PeakMemory(device, collect=config.collect_garbage) as mem_decode:
        _sync(device)
        t0 = time.perf_counter()
        generated = decode(model, cache, logits, config.new_tokens)
        _sync(device)
        decode_s = time.perf_counter() - t0
    stats_end = cache.stats()
    check(timer.wrapped_layers() == len(stats_end.evicting_layers),
          "eviction timer missed a layer created after the cache was built")
    times = timer.totals()
    timer.detach()
    same_size_s = None
    if same_size:
        same_size_s = time_decode(model, same_size_full_cache(model, shapes), logits, config.new_tokens)
    pre, dec = mem_prefill.reading, mem_decode.reading
    row.update(
        status="ok",
        prefill_s=prefill_s,
        scoring_s=scoring_s,
        scoring_passes=len(passes),
        decode_s=decode_s,
        decode_tokens=config.new_tokens,
        decode_untimed_s=untimed_s,
        decode_same_size_full_s=same_size_s,
        **times,
        prefill_evictions=timer.evictions.get("prefill", 0),
        decode_evictions=timer.evictions.get("decode", 0),
        stored_bytes_prefill=stats_prefill.bytes_stored,
        full_bytes_prefill=stats_prefill.bytes_full,
        stored_bytes_end=stats_end.bytes_stored,
        allocated_bytes_prefill=stats_prefill.bytes_allocated,
        allocated_bytes_end=stats_end.bytes_allocated,
        full_bytes_end=stats_end.bytes_full,
        bookkeeping_bytes_end=stats_end.bytes_bookkeeping,
        stored_per_layer_prefill=[min(stats_prefill.mean_stored_per_layer), max(stats_prefill.mean_stored_per_layer)],
        peak_per_layer=[min(stats_end.peak_per_layer), max(stats_end.peak_per_layer)],
        kv_peak_layer_sum_bytes=kv_peak_layer_sum(cache),
        kv_live_peak_bytes=timer.live_peak_bytes,
        mem_kind=pre.kind,
        mem_peak_prefill_bytes=pre.peak_bytes,
        # the decode block starts where the prefill left memory: shift its peak to the prefill's start
        mem_peak_bytes=max(pre.peak_bytes, dec.start_bytes - pre.start_bytes + dec.peak_bytes),
        first_tokens=generated[0, :8].tolist(),
    )
    if paths:  # untimed, after the timed blocks: the tensor peak of each way a user runs the prompt
        peaks = path_peaks(model, spec.build(n, config.compression_ratio), ids, sizes, passes)
        row.update({f"path_peak_{path}_bytes": peak for path, peak in peaks.items()})
        row["path_peak_kind"] = "cuda" if device.type == "cuda" else "cpu-tensors"
        layers = len(stats_prefill.evicting_layers)
        row["layer_prompt_bytes"] = stats_prefill.bytes_full // layers if layers else None
    return (row, cache) if return_cache else row


@torch.no_grad()
def trace_cell(model, spec: MethodSpec, ids: torch.Tensor, config: BenchConfig, tokenizer=None) -> dict:
    """Stored KV bytes vs tokens seen: one point after each prompt chunk and each decode step (and after
    the scoring passes of methods that have them)."""
    device = model_device(model)
    n = ids.shape[-1]
    out = {"method": spec.label, "prompt_tokens": n}
    try:
        method = spec.build(n, config.compression_ratio)
        passes = scoring_passes(method, ids, tokenizer)
    except KvtrimError as err:
        return {**out, "status": "skipped", "reason": str(err)}
    sizes, schedule = trace_schedule(method, n)
    cache = TrimCache(method, config=model.config)
    points: list[list[int]] = []

    def record():
        s = cache.stats()
        points.append([s.tokens_seen, s.bytes_stored, s.bytes_full])

    logits = _feed(model, ids.to(device), cache, sizes, each_chunk=record, end_prompt=not passes)
    if passes:
        run_scoring_passes(model, cache, passes)
        cache.end_prompt()
        record()
    decode(model, cache, logits, config.trace_decode, each_step=record)
    return {**out, "status": "ok", "method_repr": method.describe(), "schedule": schedule,
            "columns": ["tokens_seen", "bytes_stored", "bytes_full"], "points": points}


# ---- the whole run ------------------------------------------------------------------------------
def environment(model, config: BenchConfig) -> dict:
    import transformers

    import kvtrim

    device = model_device(model)
    env = {
        "kvtrim": kvtrim.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "model_class": type(model).__name__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        env["loadavg_start"] = list(os.getloadavg())
    except OSError:
        pass
    return env


def run_bench(model, tokenizer, config: BenchConfig, progress: Callable[[str], None] = print,
              model_info: dict | None = None, bar: bool = False,
              checkpoint: Callable[[dict], None] | None = None) -> dict:
    """Run the whole benchmark; returns `{"schema", "meta", "raw", "summary", "trace"}`.

    `progress` gets notices and, without `bar`, one line per measured cell; `bar` shows a tqdm progress
    bar on stderr instead (the same bar as `kvtrim eval`, with an ETA). `checkpoint` receives the result
    so far (`meta["complete"]` False) after every measured cell and trace, so that an interrupted or
    failing run keeps what it measured.
    """
    from tqdm.auto import tqdm

    from kvtrim.bench.summary import summarize, summarize_batches

    config.validate()
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    vocab = getattr(model.config, "vocab_size", None)
    prompts = {}
    for length in config.lengths:
        n = fitted_length(model, length, config.new_tokens)
        if n < length:
            progress(f"length {length}: {n} prompt tokens, leaving room for {config.new_tokens} new tokens within "
                     f"the model's context of {model.config.max_position_embeddings}")
        prompts[length] = prompt_ids(tokenizer, n, config.seed, vocab)
    meta = {"config": config.as_dict(), "env": environment(model, config), "model": model_info or {}}
    meta["prompt_tokens"] = {str(k): int(v.shape[-1]) for k, v in prompts.items()}
    started = time.perf_counter()
    raw: list[dict] = []
    trace: list[dict] = []

    def result(complete: bool) -> dict:
        meta["complete"] = complete
        meta["wall_s"] = time.perf_counter() - started
        out = {"schema": SCHEMA, "meta": meta, "raw": raw, "summary": summarize(raw, config.compression_ratio),
               "trace": trace}
        if config.batch_sizes != [1]:
            out["batch_summary"] = summarize_batches(raw)
        return out

    def save() -> None:
        if checkpoint is not None:
            checkpoint(result(complete=False))

    batches = {(length, b): batch_prompt_ids(prompts[length], tokenizer, b, config.seed, vocab)
               for length in config.lengths for b in config.batch_sizes}
    total = config.repeats * len(batches) * len(config.methods)
    cells = total + (len(config.methods) if config.warmup else 0) + (len(config.methods) if config.trace_length else 0)
    status = tqdm(total=cells, desc="kvtrim bench", unit="cell", disable=not bar, dynamic_ncols=True, file=sys.stderr)

    def say(message: str) -> None:
        if bar:
            status.write(message, file=sys.stderr)
        else:
            progress(message)

    try:
        if config.warmup:
            # one short cell per method (first calls pay one-time costs); 512 tokens at most
            short = min(prompts, key=lambda k: prompts[k].shape[-1])
            warm = BenchConfig(**{**config.__dict__, "new_tokens": 2})
            for spec in config.methods:
                status.set_postfix_str(f"warm-up {spec.label}", refresh=False)
                measure_cell(model, spec, prompts[short][:, :512], warm, short, tokenizer=tokenizer)
                status.update(1)
            say(f"warm-up done ({time.perf_counter() - started:.0f} s)")

        last_round = 0.0
        meta["repeats_done"] = 0
        for repeat in range(config.repeats):
            elapsed = time.perf_counter() - started
            if config.time_budget_s and repeat > 0 and elapsed + last_round > config.time_budget_s:
                say(f"time budget: stopping after {repeat} repeat(s)")
                break
            round_start = time.perf_counter()
            for length, batch in batches:
                k = repeat % len(config.methods)
                order = config.methods[k:] + config.methods[:k]
                for position, spec in enumerate(order):
                    paths = config.path_memory and repeat == 0 and batch == min(config.batch_sizes)
                    row = measure_cell(model, spec, batches[length, batch], config, length, repeat, position,
                                       tokenizer=tokenizer, paths=paths)
                    raw.append(row)
                    save()
                    if row["status"] == "ok":
                        scoring = f", scoring passes {row['scoring_s']:.2f} s" if row["scoring_passes"] else ""
                        line = (f"{spec.label} @ {row['prompt_tokens']}: prefill {row['prefill_s']:.2f} s "
                                f"(evict {row['prefill_evict_s'] * 1000:.1f} ms){scoring}, decode "
                                f"{row['decode_tokens'] / row['decode_s']:.1f} tok/s, stored "
                                f"{row['stored_bytes_prefill'] / 2**20:.1f} MiB")
                    else:
                        line = f"{spec.label} @ {length}: skipped ({row['reason']})"
                    if bar:
                        status.set_postfix_str(line, refresh=False)
                        status.update(1)
                    else:
                        progress(f"[{len(raw)}/{total}] {line}")
            last_round = time.perf_counter() - round_start
            meta["repeats_done"] = repeat + 1

        out_of_time = config.time_budget_s and time.perf_counter() - started + last_round / 2 > config.time_budget_s
        if out_of_time:
            say("time budget: no stored-bytes trace")
        if config.trace_length and not out_of_time:
            n = fitted_length(model, config.trace_length, config.trace_decode)
            ids = prompt_ids(tokenizer, n, config.seed, vocab)
            for spec in config.methods:
                status.set_postfix_str(f"trace {spec.label}", refresh=False)
                trace.append(trace_cell(model, spec, ids, config, tokenizer=tokenizer))
                save()
                status.update(1)
            say(f"stored-bytes trace done at {ids.shape[-1]} tokens")
    finally:
        status.close()

    try:
        meta["env"]["loadavg_end"] = list(os.getloadavg())
    except OSError:
        pass
    return result(complete=True)
