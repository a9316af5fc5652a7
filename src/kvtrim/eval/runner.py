"""The sweep: methods x (compression ratios and budgets) x samples (tasks x lengths), resumable.

Per sample:
1. encode it (`PromptFormat`): the compressed part (context; or context + question with
   `query_aware`) and the part fed after compression (question + answer prefix; or nothing);
2. if several pending methods can reuse a prefill, compress the context once into a full cache
   (`kvtrim.compress(..., FullCache(), record_queries=...)`, recording queries when a method needs them);
3. for each pending (method, ratio): build the method (`MethodSpec.build`), compress the context with it
   (`CompressedContext.recompress` of the shared prefill, exact for one-shot prefills, or
   `kvtrim.compress` directly: block-wise for methods that prefill block by block), measure the
   achieved compression, feed the question (an append), decode greedily, score, and append one row to
   `results.jsonl` at once.

A cell is sized by a compression ratio (`budget = kept_count(prompt, ratio)`, the method's at-budget
or ratio form) or by an absolute budget (`--budgets`: that many entries per KV head and layer whatever
the prompt's length; `compression_ratio` is null in its rows). Decode-time methods keep evicting while
the answer grows, so each row also records the cache during decoding: `stored_trace` (entries held, the
largest layer, before the first decode forward and after each one), `peak_stored` (the most entries a
layer held during a decode forward, its new token included, before that step's eviction),
`final_stored` and `final_compression` (KV bytes removed at the end of the generation).

Rows are keyed by `sample id | method label | compression ratio` (or `| b<budget>`); rows already in `results.jsonl` are
skipped, so an interrupted run resumes where it stopped (a row cut by the interruption is removed from
the file first and redone, see `kvtrim.eval.jsonl`). `run.json` records the settings that change
results (model, dtype, prompt format, protocol, token cap); resuming into a folder whose settings differ
is refused.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from kvtrim.attention import is_enabled
from kvtrim.cache import CacheStats, TrimCache, TrimLayer
from kvtrim.compress import CompressedContext, compress
from kvtrim.decoding import eos_ids, forward_last_logits, greedy_decode, greedy_decode_batch, pad_token_id
from kvtrim.eval.jsonl import read_jsonl
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.sample import Sample
from kvtrim.eval.scoring import LONGBENCH_METRICS, score_prediction
from kvtrim.methods.base import EvictionMethod, KvtrimError, check, kept_count
from kvtrim.methods.full import FullCache
from kvtrim.prefill import padded_layout
from kvtrim.specs import MethodSpec

RESULTS = "results.jsonl"
RUN_FILE = "run.json"


@dataclass
class RunSettings:
    """What changes the results of a row besides its key; stored in `run.json`."""

    model: str
    dtype: str = "float32"
    chat: bool = True
    query_aware: bool = False
    compression: str = "at-budget"
    max_new_tokens: int | None = None  # cap on every sample's own max_new_tokens
    prefill_chunk_size: int | None = None  # force a chunked prefill for every method (no reuse)
    reuse_prefill: bool = True
    # stop decoding once the answer holds every reference: string_match / passkey scores cannot change
    # after that (containment survives appended text), only the stored prediction is shorter
    stop_when_answered: bool = True
    # sequences per batched forward (`--batch-size`; with a server: requests in flight); does not change the
    # rows (exact in float32), so a run may resume with another batch size
    batch_size: int = 1
    # what produced the rows: "transformers" (in-process, kvtrim's TrimCache) or "vllm" (`kvtrim eval --server`:
    # requests to a `kvtrim serve` server, whose model id is `server_model`); rows of the two never share a folder
    backend: str = "transformers"
    server_model: str | None = None


@dataclass
class Job:
    """One row: a sample and a method at a compression ratio, or at an absolute `budget` (ratio None)."""

    sample: Sample
    spec: MethodSpec
    compression_ratio: float | None
    budget: int | None = None

    @property
    def key(self) -> str:
        return row_key(self.sample.id, self.spec.label, self.compression_ratio, self.budget)


def row_key(sample_id: str, method_label: str, compression_ratio: float | None, budget: int | None = None) -> str:
    setting = f"b{budget}" if budget is not None else f"{compression_ratio:g}"
    return f"{sample_id}|{method_label}|{setting}"


def load_rows(out_dir: str, repair: bool = False) -> list[dict]:
    """The rows of `out_dir/results.jsonl`; a last line cut by an interruption is dropped with a warning
    (and cut off the file with `repair`); any other unparseable line is an error."""
    return read_jsonl(os.path.join(out_dir, RESULTS), repair=repair)


def sample_budget(sample: Sample, cap: int | None) -> int:
    """Tokens to generate for `sample`: its own `max_new_tokens`, capped by `cap` (--max-new-tokens)."""
    return sample.max_new_tokens if cap is None else min(cap, sample.max_new_tokens)


def check_sample_fits(fmt: PromptFormat, sample: Sample, cap: int | None, limit: int | None) -> None:
    """Refuse a sample whose prompt plus the tokens to generate exceeds the model's context `limit`."""
    if not limit:
        return
    prefix, suffix = fmt.encode(sample)
    need = prefix.shape[-1] + suffix.shape[-1] + sample_budget(sample, cap)
    check(need <= limit, f"sample {sample.id} needs {need} tokens (prompt + max_new_tokens), beyond the model's "
                         f"context of {limit}")


_NOT_RESULTS = ("reuse_prefill", "batch_size")  # settings that change how rows are computed, not the rows


def check_run_settings(out_dir: str, settings: RunSettings) -> None:
    """Create `run.json`, or refuse to mix results made with other settings into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, RUN_FILE)
    current = asdict(settings)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            previous = json.load(f)
        # a key missing from an older run.json predates its setting: that run had the default
        defaults = asdict(RunSettings(model=""))
        diff = [k for k in current if k not in _NOT_RESULTS and previous.get(k, defaults.get(k)) != current[k]]
        check(not diff, f"{out_dir} holds results made with other settings ({', '.join(f'{k}={previous.get(k)!r}' for k in diff)}); "
                        "use another --out or the same settings")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(current, f, indent=1)


def job_row(job: Job, n: int, m: int, query_aware: bool, backend: str = "transformers") -> dict:
    """The fields of `job`'s row known before it runs (`n` compressed tokens, `m` fed after), whatever runs it."""
    sample = job.sample
    return {
        "key": job.key, "sample_id": sample.id, "task": sample.task, "length": sample.length,
        "depth": sample.depth, "method": job.spec.label, "method_name": job.spec.name,
        "compression_ratio": job.compression_ratio,
        "budget": job.budget if job.budget is not None else kept_count(n, job.compression_ratio),
        "compressed_tokens": n, "prompt_tokens": n + m, "query_aware": query_aware,
        "metric": sample.metric, "answers": sample.answers,
        **({"haystack": sample.meta["haystack"]} if "haystack" in sample.meta else {}),
        "backend": backend,
    }


def answered_rule(sample: Sample, tokenizer, stop_when_answered: bool):
    """The stop-when-answered rule of `sample`: `tokens -> True` once the answer holds every reference (None
    with --full-answers, or for LongBench's metrics, whose scores can fall as text is appended)."""
    if not stop_when_answered or sample.metric in LONGBENCH_METRICS:
        return None
    return lambda t: score_prediction(  # noqa: E731
        sample.metric, tokenizer.decode(t, skip_special_tokens=True), sample.answers)["score"] >= 1


def answer_fields(tokenizer, sample: Sample, tokens: list[int], budget: int, done) -> dict:
    """A row's answer and its scores from the greedy `tokens` (stop tokens excluded) of at most `budget`."""
    prediction = tokenizer.decode(tokens, skip_special_tokens=True)
    return dict(
        prediction=prediction, new_tokens=len(tokens), max_new_tokens=budget,
        stopped_when_answered=bool(done and tokens and len(tokens) < budget and done(tokens)),
        **score_prediction(sample.metric, prediction, sample.answers, sample.meta.get("all_classes"),
                           bool(sample.meta.get("first_line"))),
    )


def plan(samples: list[Sample], specs: list[MethodSpec], ratios: list[float],
         budgets: list[int] | tuple[int, ...] = ()) -> list[Job]:
    """All (sample, method, ratio) and (sample, method, budget) jobs; `full` once per sample at ratio 0.

    Per sample: `full`, then every method at the first setting (ratios, then budgets, as given), then at
    the next: an interrupted sweep leaves whole columns of methods to compare."""
    settings = [(r, None) for r in ratios] + [(None, b) for b in budgets]
    jobs = []
    for sample in samples:
        jobs += [Job(sample, spec, 0.0) for spec in specs if spec.is_full]
        jobs += [Job(sample, spec, r, b) for r, b in settings for spec in specs if not spec.is_full]
    return jobs


@dataclass(frozen=True)
class RowStats:
    """What a row records of its sequence's cache: KV bytes stored and those of a full cache (the achieved
    compression), and the entries per (layer, kv_head) on average."""

    bytes_stored: int
    bytes_full: int
    stored_per_layer_mean: float

    @property
    def compression_ratio(self) -> float:
        return 0.0 if self.bytes_full == 0 else 1.0 - self.bytes_stored / self.bytes_full

    @classmethod
    def of(cls, stats: CacheStats) -> RowStats:
        """A cache holding one sequence."""
        mean = stats.mean_stored_per_layer
        return cls(stats.bytes_stored, stats.bytes_full, sum(mean) / max(1, len(mean)))

    @classmethod
    def of_row(cls, cache: TrimCache, i: int, seen: int) -> RowStats:
        """Sequence `i` of a batched cache, having seen `seen` tokens: what `of(cache.stats())` reads of a
        cache holding that sequence alone (the same sums over its own rows' stored lengths)."""
        stored = full = 0
        means = []
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            if isinstance(layer, TrimLayer):
                row = layer.lengths[i].tolist()
                head_dim = layer.storage.head_dim if layer.is_ragged else layer.keys.shape[-1]
                entry = head_dim * 2 * layer.kv_tensors()[0].element_size()
                stored += sum(row) * entry
                full += len(row) * seen * entry
            else:  # a sliding-window layer: what it holds, as `CacheStats` counts it
                b, h, n = layer.keys.shape[:3]
                row = [n] * h
                kv = (layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()) // b
                stored += kv
                full += kv
            means.append(sum(row) / max(1, len(row)))
        return cls(stored, full, sum(means) / max(1, len(means)))

    @staticmethod
    def largest_layers(cache: TrimCache) -> list[int]:
        """Per sequence, its entries in its fullest layer and kv_head (`max(stats().stored_per_layer)` of a
        cache holding that sequence alone)."""
        layers = cache.stats().lengths_per_layer
        return [max(max(rows[i]) for rows in layers) for i in range(len(layers[0]))]


@dataclass
class Runner:
    model: object
    tokenizer: object
    settings: RunSettings
    out_dir: str
    progress: bool = True
    _stop: set[int] = field(default_factory=set)
    _shared_queries: bool = False
    _bar: object = None  # the progress bar while `run` runs
    rows_written: int = 0  # rows appended by this runner (also when a run is interrupted)

    def __post_init__(self):
        self.fmt = PromptFormat(self.tokenizer, chat=self.settings.chat)
        self._stop = eos_ids(self.model, self.tokenizer)

    # ---- one sample --------------------------------------------------------------------------
    def encode(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        """`(compressed ids (1, n), ids fed after compression (1, m))`; m may be 0 (query-aware)."""
        prefix, suffix = self.fmt.encode(sample)
        if self.settings.query_aware:
            return torch.cat([prefix, suffix], dim=-1), suffix[:, :0]
        return prefix, suffix

    def build(self, job: Job, n: int) -> EvictionMethod:
        return job.spec.build(n, job.compression_ratio, self.settings.compression, budget=job.budget)

    def _row(self, job: Job, n: int, m: int) -> dict:
        """The fields of `job`'s row known before it runs (`n` compressed tokens, `m` fed after)."""
        return job_row(job, n, m, self.settings.query_aware)

    def _done(self, sample: Sample):
        """The stop-when-answered rule of `sample` (None with --full-answers)."""
        return answered_rule(sample, self.tokenizer, self.settings.stop_when_answered)

    def _finish(self, row: dict, sample: Sample, tokens: list[int], budget: int, done, stats: RowStats,
                final: RowStats, trace: list[int], reused: bool, seconds: float) -> dict:
        row.update(
            **answer_fields(self.tokenizer, sample, tokens, budget, done),
            achieved_compression=stats.compression_ratio, final_compression=final.compression_ratio,
            # a decode forward holds the entries before it plus its token until its eviction
            peak_stored=max(trace[:-1]) + 1 if len(trace) > 1 else None, final_stored=trace[-1],
            stored_trace=trace,
            kv_bytes=stats.bytes_stored, kv_bytes_full=stats.bytes_full,
            stored_per_layer_mean=stats.stored_per_layer_mean,
            prefill_reused=reused, seconds=round(seconds, 3),
        )
        return row

    def _compress(self, method: EvictionMethod, compressed: torch.Tensor,
                  shared: CompressedContext | None) -> tuple[CompressedContext, bool]:
        """`compressed` in `method`'s cache: replayed from `shared` where exact, else prefilled; and
        whether it was replayed."""
        reused = shared is not None and self._can_reuse(method, shared)
        if reused:
            return shared.recompress(method), True
        return compress(self.model, compressed, method, chunk_size=self.settings.prefill_chunk_size or "auto",
                        tokenizer=self.tokenizer), False

    def run_job(self, job: Job, compressed: torch.Tensor, after: torch.Tensor,
                shared: CompressedContext | None) -> dict:
        n = compressed.shape[-1]
        row = self._row(job, n, after.shape[-1])
        try:
            method = self.build(job, n)
        except KvtrimError as err:
            row.update(skipped=str(err))
            return row
        row["method_config"] = method.describe()
        start = time.perf_counter()
        ctx, reused = self._compress(method, compressed, shared)
        # one question per compression: its cache is used up, no copy needed
        return self._answer(row, job.sample, ctx.cache, ctx.logits, after, reused, start)

    def _answer(self, row: dict, sample: Sample, cache: TrimCache, logits: torch.Tensor, after: torch.Tensor,
                reused: bool, start: float) -> dict:
        """Feed the question `after` into `cache` (holding the compressed context, `logits` its last
        token's), decode the answer greedily and finish `row`."""
        stats = RowStats.of(cache.stats())
        if after.shape[-1]:
            logits = forward_last_logits(self.model, after, cache)
        budget = sample_budget(sample, self.settings.max_new_tokens)
        done = self._done(sample)
        trace = [max(cache.stats().stored_per_layer)]  # the largest layer's entries, before decoding

        def watch() -> None:
            trace.append(max(cache.stats().stored_per_layer))

        tokens = greedy_decode(self.model, cache, logits, budget, self._stop, done, watch)
        return self._finish(row, sample, tokens, budget, done, stats, RowStats.of(cache.stats()), trace, reused,
                            time.perf_counter() - start)

    def run_batch(self, jobs: list[Job], method: EvictionMethod, encoded: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  shared: CompressedContext | None) -> list[dict]:
        """The rows of `jobs` (one cell, distinct samples, every one configured as `method`) from one batched
        compression and one batched greedy decoding; each row equals `run_job`'s (float32, greedy).

        Per row, the cache is read from its own sequence: its stored lengths, and its own tokens seen
        (`RowStats.of_row`); decoding follows `greedy_decode`'s rules per row (`greedy_decode_batch`).
        `shared`: a one-shot full prefill of exactly these samples, in this order, to replay."""
        b = len(jobs)
        compressed = [encoded[job.sample.id][0] for job in jobs]
        after = [encoded[job.sample.id][1] for job in jobs]
        n, m = [c.shape[-1] for c in compressed], [a.shape[-1] for a in after]
        padded = len(set(n)) > 1 or len(set(m)) > 1  # each sequence alone in a padded batch (`kvtrim.compress`)
        check(not padded or self._pads(method), f"{type(method).__name__} cannot run a padded batch")
        rows = [self._row(job, n[i], m[i]) for i, job in enumerate(jobs)]
        for row in rows:
            row["method_config"] = method.describe()
        start = time.perf_counter()
        reused = shared is not None and not padded and self._can_reuse(method, shared)
        chunk = self.settings.prefill_chunk_size or "auto"
        if reused:
            ctx = shared.recompress(method)
        elif padded:
            ctx = compress(self.model, [c[0] for c in compressed], method, chunk_size=chunk, tokenizer=self.tokenizer)
        else:
            ctx = compress(self.model, torch.cat(compressed), method, chunk_size=chunk, tokenizer=self.tokenizer)
        cache, logits, mask = ctx.cache, ctx.logits, ctx.attention_mask
        seen = list(n)  # tokens each sequence has seen
        stats = [RowStats.of_row(cache, i, seen[i]) for i in range(b)]
        if max(m):
            if padded:  # the questions left-padded after the contexts' layout
                ids, question_mask, _ = padded_layout([a[0] for a in after], None, pad_token_id(self.model) or 0)
                mask = torch.cat([mask, question_mask.to(mask.device)], dim=-1)
                logits = forward_last_logits(self.model, ids, cache, mask)
            else:
                logits = forward_last_logits(self.model, torch.cat(after), cache)
            seen = [s + k for s, k in zip(seen, m)]
        budgets = [sample_budget(job.sample, self.settings.max_new_tokens) for job in jobs]
        done = [self._done(job.sample) for job in jobs]
        trace = [[largest] for largest in RowStats.largest_layers(cache)]
        final: dict[int, RowStats] = {}

        def watch(fed: list[int]) -> None:
            largest = RowStats.largest_layers(cache)
            for i in fed:
                seen[i] += 1
                trace[i].append(largest[i])

        def finished(i: int) -> None:
            final[i] = RowStats.of_row(cache, i, seen[i])

        tokens = greedy_decode_batch(self.model, cache, logits, budgets, self._stop, done, watch, finished, mask)
        seconds = (time.perf_counter() - start) / b  # each row's share of the batch
        out = []
        for i, job in enumerate(jobs):
            rows[i]["batch_size"] = b
            out.append(self._finish(rows[i], job.sample, tokens[i], budgets[i], done[i], stats[i], final[i],
                                    trace[i], reused, seconds))
        return out

    def _reusable(self, method: EvictionMethod) -> bool:
        """True when `method`'s cache after a shared one-shot prefill equals its own compression."""
        return (self.settings.prefill_chunk_size is None and method.prefill_block_size() is None
                and not method.scoring_passes)

    def _can_reuse(self, method: EvictionMethod, shared: CompressedContext) -> bool:
        if not self._reusable(method):
            return False
        return not method.waits_for_attention or self._shared_queries

    def _wants_shared(self, jobs: list[Job], n: int) -> tuple[bool, bool]:
        """(run a shared prefill?, capture queries?) for the pending jobs of one sample."""
        if not self.settings.reuse_prefill or self.settings.prefill_chunk_size is not None:
            return False, False
        methods = []
        for job in jobs:
            try:
                methods.append(self.build(job, n))
            except KvtrimError:
                continue
        reusable = [m for m in methods if self._reusable(m)]
        if len(reusable) < 2:  # one method: prefilling it directly costs the same
            return False, False
        return True, any(m.waits_for_attention for m in reusable) and is_enabled(self.model)

    # ---- the sweep ---------------------------------------------------------------------------
    def run_unit(self, unit: list[Job]) -> Iterator[dict]:
        """The rows of one unit of work: the pending jobs of one sample (they share its prefill), in order,
        or with `batch_size` > 1 those of up to `batch_size` samples of one task and length (`pending_units`),
        run in batches (`run_batched_unit`).

        A unit is what `kvtrim eval --ray` sends to one worker (`kvtrim.eval.ray_sweep`)."""
        if len({job.sample.id for job in unit}) > 1:
            if self.settings.batch_size == 1:  # the samples share one context (`pending_units`)
                yield from self.run_context_group(unit)
            else:
                yield from self.run_batched_unit(unit)
            return
        sample = unit[0].sample
        check_sample_fits(self.fmt, sample, self.settings.max_new_tokens, self._limit)
        yield from self._run_sample(unit, *self.encode(sample))

    def run_context_group(self, unit: list[Job]) -> Iterator[dict]:
        """The jobs of several samples that share one context (kvpress's "compress once, ask many"): per
        cell (method and setting), the context is compressed once, and every sample's question is fed
        into its own copy of that cache (`TrimCache.copy`) and answered. Each row equals the one its
        sample alone gives (the compressed cache and the last logits do not depend on the question).
        Samples whose compressed tokens turn out to differ (a prompt format that puts something of the
        question before the context) run one by one instead."""
        samples = list({job.sample.id: job.sample for job in unit}.values())
        for sample in samples:
            check_sample_fits(self.fmt, sample, self.settings.max_new_tokens, self._limit)
        encoded = {sample.id: self.encode(sample) for sample in samples}
        first = encoded[samples[0].id][0]
        if any(not torch.equal(encoded[s.id][0], first) for s in samples[1:]) or self.settings.query_aware:
            for sample in samples:
                yield from self._run_sample([job for job in unit if job.sample.id == sample.id], *encoded[sample.id])
            return
        n = first.shape[-1]
        cells: dict[tuple, list[Job]] = {}
        for job in unit:
            cells.setdefault((job.spec.label, job.compression_ratio, job.budget), []).append(job)
        representatives = [jobs[0] for jobs in cells.values()]
        want, queries = self._wants_shared(representatives, n)
        self._shared_queries = queries
        shared = compress(self.model, first, FullCache(), None, queries) if want else None
        prepared = self._kvzip_contexts(representatives, first, shared)
        for jobs in cells.values():
            rows = [self._row(job, n, encoded[job.sample.id][1].shape[-1]) for job in jobs]
            try:
                method = self.build(jobs[0], n)
            except KvtrimError as err:
                for row in rows:
                    row.update(skipped=str(err))
                    yield row
                continue
            self._show(jobs[0], len(jobs))
            start = time.perf_counter()
            if jobs[0].key in prepared:  # KVzip, its scores shared with its other settings
                ctx, seconds, sharing = prepared.pop(jobs[0].key)
                reused, start = True, start - seconds
            else:
                (ctx, reused), sharing = self._compress(method, first, shared), None
            shared_seconds = (time.perf_counter() - start) / len(jobs)  # each row's share of the compression
            for job, row in zip(jobs, rows):
                row["method_config"] = ctx.method.describe()
                row["context_group"] = len(jobs)
                if sharing:
                    row["kvzip_scores_shared"] = sharing
                cache = ctx.new_cache()
                yield self._answer(row, job.sample, cache, ctx.logits, encoded[job.sample.id][1], reused,
                                   time.perf_counter() - shared_seconds)
        del shared

    def _run_sample(self, jobs: list[Job], compressed: torch.Tensor, after: torch.Tensor) -> Iterator[dict]:
        """One sample's jobs, one at a time, replaying its shared prefill where two or more can (and
        KVzip's scores, where it runs at two or more settings: `_kvzip_contexts`)."""
        want, queries = self._wants_shared(jobs, compressed.shape[-1])
        self._shared_queries = queries
        shared = compress(self.model, compressed, FullCache(), None, queries) if want else None
        prepared = self._kvzip_contexts(jobs, compressed, shared)
        for job in jobs:
            self._show(job)
            if job.key in prepared:
                yield self._run_prepared(job, compressed, after, *prepared.pop(job.key))
            else:
                yield self.run_job(job, compressed, after, shared)
        del shared

    def _kvzip_contexts(self, jobs: list[Job], compressed: torch.Tensor,
                        shared: CompressedContext | None) -> dict[str, tuple[CompressedContext, float, int]]:
        """KVzip's compressed contexts for `jobs` (one per cell) that score alike, two or more of them,
        with its scoring passes run once (`kvtrim.eval.kvzip_reuse`): job key -> (context, this row's share
        of the shared seconds, how many rows share the scores). Empty without prefill reuse."""
        if not self.settings.reuse_prefill or self.settings.prefill_chunk_size is not None:
            return {}
        from kvtrim.eval.kvzip_reuse import score_once, scoring_key

        groups: dict[tuple, list[tuple[Job, EvictionMethod]]] = {}
        n = compressed.shape[-1]
        for job in jobs:
            try:
                method = self.build(job, n)
            except KvtrimError:
                continue
            key = scoring_key(method)
            if key is not None:
                groups.setdefault(key, []).append((job, method))
        out = {}
        for group in groups.values():
            if len(group) < 2:
                continue
            contexts, seconds = score_once(self.model, self.tokenizer, compressed, [m for _, m in group],
                                           shared if shared is not None and shared.one_shot_full else None)
            for (job, _), ctx in zip(group, contexts):
                out[job.key] = (ctx, seconds / len(group), len(group))
        return out

    def _run_prepared(self, job: Job, compressed: torch.Tensor, after: torch.Tensor, ctx: CompressedContext,
                      shared_seconds: float, sharing: int) -> dict:
        """`run_job` for a context already compressed (KVzip from shared scores)."""
        row = self._row(job, compressed.shape[-1], after.shape[-1])
        row["method_config"] = ctx.method.describe()
        row["kvzip_scores_shared"] = sharing
        return self._answer(row, job.sample, ctx.cache, ctx.logits, after, True, time.perf_counter() - shared_seconds)

    def _show(self, job: Job, size: int = 1) -> None:
        if self._bar is not None:
            setting = f"b={job.budget}" if job.budget is not None else f"r={job.compression_ratio:g}"
            batch = f" x{size}" if size > 1 else ""
            self._bar.set_postfix_str(f"{job.sample.task} {job.spec.label} {setting}{batch}", refresh=False)

    def run_batched_unit(self, unit: list[Job]) -> Iterator[dict]:
        """The rows of several samples' pending jobs: cell (method and setting) by cell in plan order, in
        batches; then the jobs left alone, sample by sample as `run_unit` runs them.

        A cell's jobs run in batches of the samples whose method is configured identically
        (`describe()`: in the at-budget form a ratio sizes each method from its own prompt's length, so
        `--budgets` and `--compression ratio` batch more). Prompts of different lengths make a padded
        batch where the method can take one (`_pads`), else only prompts of equal lengths batch. With
        prefill reuse, methods that replay a shared prefill batch only when all the unit's prompts have
        equal lengths (their contexts are then prefilled once together); otherwise they run one sample at a
        time, replaying its prefill as batch 1 does (a padded batch would be prefilled by each method
        anew: `CompressedContext.recompress` does not take a padded batch yet)."""
        samples = list({job.sample.id: job.sample for job in unit}.values())
        for sample in samples:
            check_sample_fits(self.fmt, sample, self.settings.max_new_tokens, self._limit)
        encoded = {sample.id: self.encode(sample) for sample in samples}
        cells: dict[tuple, list[Job]] = {}
        for job in unit:
            cells.setdefault((job.spec.label, job.compression_ratio, job.budget), []).append(job)
        built: dict[str, EvictionMethod | None] = {}
        for job in unit:
            try:
                built[job.key] = self.build(job, encoded[job.sample.id][0].shape[-1])
            except KvtrimError:
                built[job.key] = None  # recorded as skipped by run_job
        replay = self.settings.reuse_prefill and sum(
            any(built[job.key] is not None and self._reusable(built[job.key]) for job in jobs)
            for jobs in cells.values()) >= 2
        equal = len({tuple(x.shape[-1] for x in encoded[s.id]) for s in samples}) == 1  # no padding
        batches: list[tuple[list[Job], EvictionMethod]] = []
        alone: list[Job] = []
        for jobs in cells.values():
            groups: dict[tuple, tuple[list[Job], EvictionMethod]] = {}
            for job in jobs:
                method = built[job.key]
                if method is None:
                    alone.append(job)
                    continue
                n, m = (x.shape[-1] for x in encoded[job.sample.id])
                if replay and self._reusable(method):  # batched only with the samples' shared prefill
                    if not equal:
                        alone.append(job)
                        continue
                    key = (method.describe(),)
                elif self._pads(method):  # a one-token question is a decode step alone, not an append: apart
                    key = (method.describe(), m == 1)
                else:
                    key = (method.describe(), n, m)
                groups.setdefault(key, ([], method))[0].append(job)
            for group, method in groups.values():
                for at in range(0, len(group), self.settings.batch_size):
                    batch = group[at:at + self.settings.batch_size]
                    if len(batch) > 1:
                        batches.append((batch, method))
                    else:
                        alone += batch
        shared, together = self._shared_batch(samples, encoded, batches)
        for jobs, method in batches:
            self._show(jobs[0], len(jobs))
            ids = [job.sample.id for job in jobs]
            yield from self.run_batch(jobs, method, encoded, shared if ids == together else None)
        del shared
        by_sample: dict[str, list[Job]] = {}
        for job in alone:
            by_sample.setdefault(job.sample.id, []).append(job)
        for sample_id, jobs in by_sample.items():
            yield from self._run_sample(jobs, *encoded[sample_id])

    def _pads(self, method: EvictionMethod) -> bool:
        """True when `method` can run a padded batch (`kvtrim.compress` of a list of contexts): kvtrim's
        attention, no scoring passes, no decisions across layers."""
        return is_enabled(self.model) and not method.scoring_passes and not method.cross_layer

    def _shared_batch(self, samples: list[Sample], encoded: dict, batches: list) -> tuple[CompressedContext | None, list[str]]:
        """The shared prefill of a batched unit: all its samples' contexts in one full-cache forward, when
        their prompts have equal lengths (no padding) and two or more batches covering all of them replay
        it; and the sample ids it holds, in order."""
        ids = [s.id for s in samples]
        lengths = {(encoded[i][0].shape[-1], encoded[i][1].shape[-1]) for i in ids}
        if not self.settings.reuse_prefill or self.settings.prefill_chunk_size is not None or len(lengths) > 1:
            return None, []
        methods = [method for jobs, method in batches
                   if method is not None and [job.sample.id for job in jobs] == ids and self._reusable(method)]
        if len(methods) < 2:
            return None, []
        self._shared_queries = any(m.waits_for_attention for m in methods) and is_enabled(self.model)
        context = torch.cat([encoded[i][0] for i in ids])
        return compress(self.model, context, FullCache(), None, self._shared_queries), ids

    @property
    def _limit(self) -> int | None:
        from kvtrim.models import context_limit

        return context_limit(self.model.config)

    def run(self, jobs: list[Job]) -> list[dict]:
        """Run the jobs not yet in `results.jsonl`; returns all rows of the file afterwards."""
        from tqdm.auto import tqdm

        check_run_settings(self.out_dir, self.settings)
        units = pending_units(self.out_dir, jobs, self.settings.batch_size)
        pending = sum(len(unit) for unit in units)
        self._bar = tqdm(total=len(jobs), initial=len(jobs) - pending, desc="kvtrim eval", unit="run",
                         disable=not self.progress, dynamic_ncols=True)
        path = os.path.join(self.out_dir, RESULTS)
        try:
            with open(path, "a", encoding="utf-8") as out:
                for unit in units:
                    for row in self.run_unit(unit):
                        write_row(out, row)
                        self.rows_written += 1
                        self._bar.update(1)
        finally:
            self._bar.close()
            self._bar = None
        return load_rows(self.out_dir)


def pending_units(out_dir: str, jobs: list[Job], batch_size: int = 1) -> list[list[Job]]:
    """The jobs not yet in `out_dir/results.jsonl` (a cut last line repaired first), grouped by sample in
    plan order: the units of work, each sharing one prefill; samples with the same context share one unit
    (`Runner.run_context_group`: the context is compressed once per cell). With `batch_size` > 1, a unit holds the jobs
    of up to `batch_size` samples of one task and length (in plan order), run in batches (`Runner.run_unit`)."""
    done = {row.get("key") for row in load_rows(out_dir, repair=True)}
    by_sample: dict[str, list[Job]] = {}
    for job in jobs:
        if job.key not in done:
            by_sample.setdefault(job.sample.id, []).append(job)
    units = list(by_sample.values())
    if batch_size == 1:  # samples that share a context form one unit: compressed once, asked many
        by_context: dict[str, list[Job]] = {}
        for unit in units:
            by_context.setdefault(unit[0].sample.context, []).extend(unit)
        return list(by_context.values())
    groups: dict[tuple, list[list[Job]]] = {}
    for unit in units:
        groups.setdefault((unit[0].sample.task, unit[0].sample.length), []).append(unit)
    return [[job for unit in group[at:at + batch_size] for job in unit]
            for group in groups.values() for at in range(0, len(group), batch_size)]


def write_row(out, row: dict) -> None:
    """Append one complete line and flush it (the only damage an interruption can leave is a cut last line)."""
    out.write(json.dumps(row, ensure_ascii=False) + "\n")
    out.flush()
