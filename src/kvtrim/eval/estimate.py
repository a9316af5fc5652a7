"""What a sweep will cost, printed before it starts: the runs, and an ESTIMATE of their wall time.

The estimate is derived from the sizes of the pending runs (tokens prefilled, tokens fed after the
compression, decode steps) and two rates: a prefill's seconds per token and a decode step's seconds.
`kvtrim eval` measures them on the loaded model before the sweep starts (`probe_rates`: one prefill at the
sweep's typical context length and a few decode steps, with the run's model, dtype, device and threads: a
few seconds); where the model is not loaded in this process (Ray), it falls back on rates measured once on
this project's machine (`benchmarks/eval_estimate/rates.json`, made by `benchmarks/eval_estimate/measure.py`:
SmolLM2-135M, float32, one torch thread, CPU, a 2k-token prompt), scaled by the model's parameter count (a
forward costs about its parameters' worth of work per token). KVzip's compression (prefill + reconstruction
passes) costs its measured multiple of a prefill. Per pending context (samples that share one are
compressed once per method and setting, as `Runner` does): one shared prefill when two or more of its
methods replay it; per method and setting: its own prefill unless it replays the shared one, KVzip's
compression, the question, and between `min_steps` (every answer right and stopped as soon as it is
complete: every reference of a `string_match_all` sample, one of a `string_match_part` one) and
`max_steps` (every answer running to its token cap) decode steps; per run: its question. The likely time
takes the share of that decode range the rows already in OUT used (a resumed sweep), else `LIKELY_SHARE`.

What it ignores: attention's growth beyond the probed length, batching, Ray, and a machine shared with
other jobs. It is an estimate, never a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the rates measured by benchmarks/eval_estimate/measure.py (copied here: the package must not read the
#: repository's benchmark folder); see rates.json there for the raw repeats
REFERENCE = {
    "params": 134_515_008,
    "prefill_s_per_token": 0.00425,
    "decode_step_s": 0.1166,
    "kvzip_s_per_token": 0.0252,
}

#: the share of the decode range (answers stopped when complete .. every answer at its cap) assumed when no
#: finished rows say otherwise; measured: 0.13 over the 3,093 qwen-rank rows so far (0.00-0.79 by task), 0.32 over
#: the quick preset's 225 committed rows (0.11-0.92 by task)
LIKELY_SHARE = 0.25


@dataclass
class Estimate:
    runs: int
    samples: int
    prefill_tokens: int
    decode_min: int
    decode_max: int
    seconds_min: float
    seconds_max: float
    scale: float  # the model's parameters / the rates' model's (1 when the rates were probed on it)
    seconds_likely: float = 0.0  # with the decode steps expected (`decode_share`)
    probed: bool = False  # rates measured on the loaded model (`probe_rates`)

    def line(self) -> str:
        def t(s: float) -> str:
            return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"

        how = ("rates probed on the loaded model" if self.probed else
               f"rates measured on 2 CPU cores, 1 thread, float32, scaled by model size x{self.scale:.2f}")
        return (f"{self.runs} runs pending ({self.samples} samples): {self.prefill_tokens:,} tokens to prefill, "
                f"{self.decode_min:,}-{self.decode_max:,} decode steps; ESTIMATED wall time {t(self.seconds_likely)} "
                f"({t(self.seconds_min)}-{t(self.seconds_max)}: answers stopped when complete .. all at their cap; "
                f"{how}; kvtrim.eval.estimate says what it ignores)")


def approx_params(config) -> int:
    """Parameters of a decoder from its config (attention + MLP per layer, embeddings, untied head)."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    h, layers = c.hidden_size, c.num_hidden_layers
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    inter = getattr(c, "intermediate_size", 4 * h)
    per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * inter
    embed = c.vocab_size * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return layers * per_layer + embed


def answer_steps(metric: str, counts: list[int]) -> int:
    """Decode steps of the shortest answer that completes a sample, from its references' token `counts`:
    every reference for `string_match_all` (with a separator between them), one for `string_match_part`,
    the longest otherwise; plus the step that would have come next."""
    if metric == "string_match_all":
        return sum(counts) + len(counts) - 1 + 1
    if metric == "string_match_part":
        return min(counts) + 1
    return max(counts) + 1


def decode_share(rows: list[dict], steps_min) -> dict[str | None, float]:
    """The share of the decode range (`steps_min(row)` .. its cap) that finished `rows` used, per task and
    over all of them (key None); empty without rows (rows written before `max_new_tokens` was recorded are
    left out)."""
    sums: dict[str | None, list[int]] = {}
    for row in rows:
        if "max_new_tokens" not in row or "new_tokens" not in row:
            continue
        cap = row["max_new_tokens"]
        low = min(steps_min(row), cap)
        for key in (row.get("task"), None):
            lo_hi_used = sums.setdefault(key, [0, 0, 0])
            lo_hi_used[0] += low
            lo_hi_used[1] += cap
            lo_hi_used[2] += min(max(row["new_tokens"], low), cap)
    return {key: (used - lo) / (hi - lo) for key, (lo, hi, used) in sums.items() if hi > lo}


def probe_rates(model, tokens: int, steps: int = 8) -> dict:
    """Rates measured on `model` as loaded (its dtype, device, threads): one prefill of `tokens` random tokens,
    then `steps` decode steps on that cache; KVzip's compression at its measured multiple of a prefill
    (`REFERENCE`). A few seconds; `estimate(..., rates=probe_rates(...), params=rates["params"])`."""
    import time

    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, max(tokens, 16)), generator=gen).to(device)
    with torch.no_grad():
        model(ids[:, :16], cache=DynamicCache(), use_cache=True)  # warm-up: first-call costs
        sync()
        start = time.perf_counter()
        cache = DynamicCache()
        token = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        sync()
        prefill = (time.perf_counter() - start) / ids.shape[-1]
        start = time.perf_counter()
        for _ in range(steps):
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        sync()
        decode = (time.perf_counter() - start) / steps
    ratio = REFERENCE["kvzip_s_per_token"] / REFERENCE["prefill_s_per_token"]
    return {"params": 1, "prefill_s_per_token": prefill, "decode_step_s": decode, "kvzip_s_per_token": prefill * ratio,
            "probed": True}


def estimate(jobs, encoded: dict[str, tuple[int, int]], build, reusable, shares, answer_tokens, budget,
             params: int, rates: dict = REFERENCE, scoring_key=lambda method: None,
             shares_used: dict[str | None, float] | None = None) -> Estimate:
    """The estimate for `jobs` (pending `Job`s).

    encoded: sample id -> (compressed tokens n, tokens fed after m). build(job, n) -> method, or None when
    it cannot be configured (the run is skipped: free). reusable(method) -> replays a shared prefill.
    shares(methods) -> whether a sample's methods get a shared prefill. answer_tokens(sample) -> decode
    steps of its shortest complete answer (`answer_steps`); budget(sample) -> its token cap. scoring_key(method) -> what KVzip's scores depend on
    (`kvtrim.eval.kvzip_reuse.scoring_key`; None: every run scores on its own). shares_used: the share of
    each task's decode range expected (`decode_share` of finished rows: the task's own, else over all rows,
    else `LIKELY_SHARE`). Probed rates
    (`probe_rates`) are the model's own: pass `params=1`."""
    scale = params / rates["params"]
    by_context: dict[str, list] = {}  # samples sharing a context are compressed once per cell
    for job in jobs:
        by_context.setdefault(job.sample.context, []).append(job)
    known = shares_used or {}
    prefill = kvzip = fed = dmin = dmax = 0
    dlikely = 0.0
    for mine in by_context.values():
        n = encoded[mine[0].sample.id][0]
        cells: dict[tuple, list] = {}
        for job in mine:
            cells.setdefault((job.spec.label, job.compression_ratio, job.budget), []).append(job)
        methods = [(cell, build(cell[0], n)) for cell in cells.values()]
        methods = [(cell, method) for cell, method in methods if method is not None]
        shared = shares([method for _, method in methods])
        prefill += n if shared else 0
        # KVzip: one scoring per context and scoring configuration shared by two or more settings
        keys = [scoring_key(method) for _, method in methods]
        shared_keys = {k for k in keys if k is not None and keys.count(k) >= 2}
        kvzip += n * len(shared_keys)
        for (cell, method), key in zip(methods, keys):
            if getattr(method, "scoring_passes", False):
                if key not in shared_keys:
                    kvzip += n
            elif not (shared and reusable(method)):
                prefill += n
            for job in cell:
                fed += encoded[job.sample.id][1]
                cap = budget(job.sample)
                low = min(cap, answer_tokens(job.sample))
                dmin += low
                dmax += cap
                dlikely += low + known.get(job.sample.task, known.get(None, LIKELY_SHARE)) * (cap - low)
    base = (prefill + fed) * rates["prefill_s_per_token"] + kvzip * rates["kvzip_s_per_token"]
    return Estimate(
        runs=len(jobs), samples=len({job.sample.id for job in jobs}), prefill_tokens=prefill + kvzip, decode_min=dmin, decode_max=dmax,
        seconds_min=scale * (base + dmin * rates["decode_step_s"]),
        seconds_max=scale * (base + dmax * rates["decode_step_s"]), scale=scale,
        seconds_likely=scale * (base + dlikely * rates["decode_step_s"]), probed=bool(rates.get("probed")),
    )

