"""What a sweep will cost, printed before it starts: the runs, and an ESTIMATE of their wall time.

The estimate is derived from the sizes of the pending runs (tokens prefilled, tokens fed after the
compression, decode steps) and rates measured once on this project's machine
(`benchmarks/eval_estimate/rates.json`, made by `benchmarks/eval_estimate/measure.py`: SmolLM2-135M,
float32, one torch thread, CPU, a 2k-token prompt), scaled by the model's parameter count (a forward
costs about its parameters' worth of work per token). Per pending context (samples that share one are
compressed once per method and setting, as `Runner` does): one shared prefill when two or more of its
methods replay it; per method and setting: its own prefill unless it replays the shared one, KVzip's compression (prefill + reconstruction passes) at its own measured rate, the question, and
between `min_steps` (every answer right and stopped as soon as it is complete) and `max_steps` (every
answer running to its token cap) decode steps; per run: its question.

What it ignores: attention's quadratic cost (an underestimate beyond a few thousand tokens), other
machines, threads, dtypes and devices (a GPU is far faster), batching, Ray, and a machine shared with
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


@dataclass
class Estimate:
    runs: int
    samples: int
    prefill_tokens: int
    decode_min: int
    decode_max: int
    seconds_min: float
    seconds_max: float
    scale: float  # the model's parameters / the reference model's

    def line(self) -> str:
        def t(s: float) -> str:
            return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"

        return (f"{self.runs} runs pending ({self.samples} samples): {self.prefill_tokens:,} tokens to prefill, "
                f"{self.decode_min:,}-{self.decode_max:,} decode steps; ESTIMATED wall time {t(self.seconds_min)}"
                f"-{t(self.seconds_max)} (rates measured on 2 shared CPU cores, 1 thread, float32, scaled by model "
                f"size x{self.scale:.2f}; kvtrim.eval.estimate says what it ignores)")


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


def estimate(jobs, encoded: dict[str, tuple[int, int]], build, reusable, shares, answer_tokens, budget,
             params: int, rates: dict = REFERENCE, scoring_key=lambda method: None) -> Estimate:
    """The estimate for `jobs` (pending `Job`s).

    encoded: sample id -> (compressed tokens n, tokens fed after m). build(job, n) -> method, or None when
    it cannot be configured (the run is skipped: free). reusable(method) -> replays a shared prefill.
    shares(methods) -> whether a sample's methods get a shared prefill. answer_tokens(sample) -> tokens of
    its longest reference; budget(sample) -> its token cap. scoring_key(method) -> what KVzip's scores depend on
    (`kvtrim.eval.kvzip_reuse.scoring_key`; None: every run scores on its own)."""
    scale = params / rates["params"]
    by_context: dict[str, list] = {}  # samples sharing a context are compressed once per cell
    for job in jobs:
        by_context.setdefault(job.sample.context, []).append(job)
    prefill = kvzip = fed = dmin = dmax = 0
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
                dmin += min(cap, answer_tokens(job.sample) + 1)
                dmax += cap
    base = (prefill + fed) * rates["prefill_s_per_token"] + kvzip * rates["kvzip_s_per_token"]
    return Estimate(
        runs=len(jobs), samples=len({job.sample.id for job in jobs}), prefill_tokens=prefill + kvzip, decode_min=dmin, decode_max=dmax,
        seconds_min=scale * (base + dmin * rates["decode_step_s"]),
        seconds_max=scale * (base + dmax * rates["decode_step_s"]), scale=scale,
    )

