"""The rates behind `kvtrim eval`'s printed wall-time estimate (`kvtrim.eval.estimate`), measured here.

On one prompt of the quick preset's niah_single_2 at 2048 tokens (SmolLM2-135M-Instruct, float32, one
torch thread): the one-shot prefill of the context (seconds per token), one greedy decode step after it,
and KVzip's compression (prefill + its reconstruction passes + selection: seconds per context token).
Repeated `--repeats` times; the median is written to rates.json.

    PYTHONPATH=src python benchmarks/eval_estimate/measure.py --out benchmarks/eval_estimate/rates.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import kvtrim
    from kvtrim.compress import compress
    from kvtrim.decoding import forward_last_logits
    from kvtrim.eval.prompt import PromptFormat
    from kvtrim.eval.tasks import generate_samples
    from kvtrim.methods import METHODS
    from kvtrim.methods.full import FullCache

    model, tok = kvtrim.load_model("smollm2-135m")
    fmt = PromptFormat(tok)
    sample = generate_samples("niah_single_2", fmt, 2048, 1)[0]
    context, question = fmt.encode(sample)
    n = context.shape[-1]
    prefill, decode, kvzip, kvzip_scoring = [], [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ctx = compress(model, context, FullCache(), None)
        prefill.append(time.perf_counter() - start)
        forward_last_logits(model, question, ctx.cache)
        start = time.perf_counter()
        steps = 8
        for _ in range(steps):
            forward_last_logits(model, torch.tensor([[tok.eos_token_id - 1]]), ctx.cache)
        decode.append((time.perf_counter() - start) / steps)
        start = time.perf_counter()
        zipped = compress(model, context, METHODS["kvzip"](compression_ratio=0.5), tokenizer=tok)
        kvzip.append(time.perf_counter() - start)
        kvzip_scoring.append(zipped.scoring_seconds)
    med = statistics.median
    out = {
        "model": "smollm2-135m", "dtype": "float32", "torch_threads": args.threads, "context_tokens": n,
        "params": sum(p.numel() for p in model.parameters()), "repeats": args.repeats,
        "prefill_s_per_token": med(prefill) / n, "decode_step_s": med(decode),
        "kvzip_s_per_token": med(kvzip) / n, "kvzip_scoring_s": med(kvzip_scoring), "kvzip_compress_s": med(kvzip),
        "prefill_s": med(prefill),
        "raw": {"prefill_s": prefill, "decode_step_s": decode, "kvzip_s": kvzip, "kvzip_scoring_s": kvzip_scoring},
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
