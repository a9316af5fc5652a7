"""Named sweeps for `kvtrim eval --preset NAME`; explicit flags override any preset value.

* `quick`: the README's main job on the default model (SmolLM2-135M-Instruct, CPU). Three RULER tasks
  that a 135M model can do at all (niah_single_1/2, vt) at 2k tokens and a NIAH grid (depths 10/50/90%
  x 1k/2k tokens), one sample per cell, every registered method at compression ratios 0.5 / 0.75 / 0.875 (each
  in its at-budget form), answers capped at 24 new
  tokens (enough for every answer of these tasks; RULER's own caps are 128/30; decoding also stops as
  soon as the answer holds every reference). Sized to finish in under 20 minutes on 2 CPU cores thanks
  to prefill reuse (17.6 min measured with one thread, 11 of them KVzip's scoring passes).
* `ruler-4k`, `ruler-16k`: the LagKV paper's RULER setup (its 13 tasks minus the two QA tasks, which need
  downloads), query-agnostic, compression ratios 0.25 / 0.5 / 0.75 / 0.875 with kvpress's convention
  (`--compression ratio`: LagKV global mode with L=128, S=4 as kvpress's `LagKVPress`, StreamingLLM,
  KeyDiff, SnapKV compress the context once; other methods use their at-budget form), RULER's max new
  tokens, on Qwen2.5-Coder-0.5B-Instruct (32k context; the default model's 8k is too short for
  ruler-16k). For a GPU: `--device cuda --dtype bfloat16`. Samples per task: 50 (4k) / 25 (16k), i.e.
  ~8-16k (method, ratio, sample) rows, a few GPU hours with a 0.5B model; kvpress and the paper use 500
  (`--samples 500`). Interrupted runs resume.
* `qwen-rank` (issue 25's ranking run, in progress: benchmarks/qwen_rank/): qwen2.5-coder-0.5b on RULER's essay niah
  tasks (`--haystack essay`), niah_single_1, vt, fwe and cwe at 2048 tokens, 25 samples per task, full and
  12 method specs (every method, KVzip at both levels, AdaKV around SnapKV / KeyDiff / KNorm) at 0.5 and
  0.75, answers capped at 64 tokens, bfloat16 (on these tasks with the full cache: the same score on 27/27
  samples as float32, 1.86x faster: benchmarks/eval_dtype/). 225 samples x 25 runs (full + 12 specs x 2 ratios) = 5,625 rows; `kvtrim
  eval` prints its estimated cost before it starts (the full cache alone: 281 s for 27 samples here).
* `reasoning`: decode-time eviction on a long answer that refers back (CPU, 2 cores): qwen2.5-coder-0.5b
  (the one offline model that solves a reasoning task with the full cache) on `list_recall` at 1024 tokens
  (≈ 560 prompt + ≈ 360 answer tokens: 32 lookups), one sample, at two absolute budgets below the
  prompt's length, so that every method evicts while the answer grows: full, LazyEviction with the window
  measured by the paper's rule (`benchmarks/reasoning/window.py`) and with its default window (128), H2O,
  TOVA, StreamingLLM, LagKV (reference mode: compresses every lag_size decoded tokens) and KeyDiff (budget
  mode: evicts every block_size decoded tokens). 15 generations, answers capped at 420 tokens: 16.9
  minutes measured on 2 quiet cores (benchmarks/reasoning/preset; 20.3 with the task's own cap of 466).
* `reasoning-gpu`: the same comparison at 4 budgets (128 .. 1024), on `list_recall` at 1k and 2k tokens
  and the trace tasks, 20 samples per cell; on a GPU (`--device cuda --dtype bfloat16`).
"""

from __future__ import annotations

from kvtrim.eval.ruler import RULER_TASKS

#: LazyEviction's window for the reasoning presets: the paper's rule (80th percentile of the MRI) measured
#: on qwen2.5-coder-0.5b / list_recall at 768 tokens (benchmarks/reasoning/window.json; at 1024 tokens
#: it gives 11, which scores like 9 there: benchmarks/reasoning/README.md)
REASONING_WINDOW = 9
#: the methods of the reasoning presets; LazyEviction twice: the measured window and the class default
REASONING_METHODS = ["full", f"lazyeviction:window={REASONING_WINDOW}", "lazyeviction", "h2o", "tova", "streaming",
                     "lagkv:lag_size=64", "keydiff"]

#: the ranking run of issue 25 (preset `qwen-rank`): every method at 0.5 / 0.75, AdaKV-wrapped scorers and
#: both KVzip levels (the first spec was plain `kvzip` while its default level was "uniform": its rows were
#: relabelled when "head" became the default; same configuration, `method_config` unchanged)
RANK_METHODS = ["full", "lagkv:lag_size=64", "streaming", "keydiff", "snapkv", "h2o", "tova", "knorm",
                "kvzip:level=uniform", "kvzip:level=head", "adakv:method=snapkv", "adakv:method=keydiff",
                "adakv:method=knorm"]

PRESETS: dict[str, dict] = {
    "quick": {
        "model": "smollm2-135m",
        "tasks": ["niah_single_1", "niah_single_2", "vt", "niah"],
        "lengths": [2048],
        "task_lengths": {"niah": [1024, 2048]},  # the depth x length grid
        "depths": [0.1, 0.5, 0.9],
        "samples": 1,
        "ratios": [0.5, 0.75, 0.875],
        "methods": None,  # every registered method, except:
        # LazyEviction evicts every `window` (128) decode steps of a long generation and keeps the prompt
        # at prefill: within a <= 24-token answer it never evicts, so it would only repeat the full cache
        "exclude": ["lazyeviction"],
        # L = 64 (the official README's example): L = 128 cannot reach 0.75 at 1k tokens (sinks + window
        # alone keep more); L = 32 drops digits of 7-digit needles (r * L close to the answer length, as
        # the paper warns). At 1k tokens 0.875 is out of reach for L = 64 too: reported as "n/a".
        "method_params": {"lagkv": "lag_size=64"},
        "max_new_tokens": 24,
        "compression": "at-budget",
    },
    "ruler-4k": {
        "model": "qwen2.5-coder-0.5b",
        "tasks": list(RULER_TASKS),
        "lengths": [4096],
        "samples": 50,
        "ratios": [0.25, 0.5, 0.75, 0.875],
        "methods": None,
        "method_params": {"lagkv": "lag_size=128:sink_size=4"},
        "compression": "ratio",
    },
    "ruler-16k": {
        "model": "qwen2.5-coder-0.5b",
        "tasks": list(RULER_TASKS),
        "lengths": [16384],
        "samples": 25,
        "ratios": [0.25, 0.5, 0.75, 0.875],
        "methods": None,
        "method_params": {"lagkv": "lag_size=128:sink_size=4"},
        "compression": "ratio",
    },
    "qwen-rank": {
        "model": "qwen2.5-coder-0.5b",
        # RULER's essay niah tasks on Paul Graham's essays, niah_single_1 (noise), vt, fwe, cwe
        "tasks": ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue",
                  "niah_multiquery", "vt", "fwe", "cwe"],
        "haystack": "essay",
        "lengths": [2048],
        "samples": 25,
        "ratios": [0.5, 0.75],
        "methods": RANK_METHODS,
        # RULER's caps are 128 (niah) / 120 (cwe): 64 holds every reference answer of these tasks at 2k
        # (4 seven-digit values, 10 words) and bounds what a failing method rambles on a CPU
        "max_new_tokens": 64,
        "compression": "at-budget",
        "dtype": "bfloat16",  # benchmarks/eval_dtype/: same scores as float32 on these tasks, 1.86x faster
    },
    "reasoning": {
        "model": "qwen2.5-coder-0.5b",
        "tasks": ["list_recall"],
        # 1024: the full cache's answers are 300+ tokens (issue #13 asks for 300-2,000); 768 gave 225-241
        "lengths": [1024],
        # one sample: 15 generations of ~360-470 tokens are what 20 minutes on 2 cores hold
        "samples": 1,
        "ratios": [],
        # 384 first: plan runs every method at one budget before the next, so an interrupted run has the
        # budget where methods differ complete; both are below the ≈ 560-token prompt
        "budgets": [384, 192],
        "methods": REASONING_METHODS,
        # the full cache's answers are 347-360 tokens (calibration, 4 samples); the task's own cap (1024 -
        # prompt = ~466) let failing methods ramble on: 420 keeps 1.17x the longest answer and fits 20 min
        "max_new_tokens": 420,
        "compression": "at-budget",
    },
    "reasoning-gpu": {
        "model": "qwen2.5-coder-0.5b",
        "tasks": ["list_recall", "program_trace", "var_trace", "arith_recall", "chain_trace"],
        "lengths": [1024, 2048],
        "samples": 20,
        "ratios": [],
        "budgets": [128, 256, 512, 1024],
        "methods": REASONING_METHODS,
        "compression": "at-budget",
    },
}
