"""How much faster 2 torch threads decode than 1: the factor that turns a loaded machine's 1-thread CPU time
into a quiet 2-core wall time.

On a shared machine wall time says little, but the process CPU time of a 1-thread run does: one thread
never waits on a partner, so its CPU seconds are close to the wall seconds it would take alone (a little
more under contention: shared caches and memory bandwidth). A quiet 2-core run then takes about
`cpu_1thread / speedup`, where `speedup` = (1-thread wall per token) / (2-thread wall per token), measured
here with short interleaved runs on the same prompt (1, 2, 1, 2, ...), so that a change of load hits both.
The result is only as quiet as the moment it ran in: the 1-minute load average is recorded with each run.

    PYTHONPATH=src .venv/bin/python benchmarks/reasoning/threads.py --model qwen2.5-coder-0.5b --length 1024
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

import kvtrim
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.tasks import generate_samples

HERE = pathlib.Path(__file__).parent


class Clock(LogitsProcessor):
    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids, scores):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--task", default="list_recall")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=32, help="decoded tokens per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "threads.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    model, tok = kvtrim.load_model(args.model, dtype=torch.float32)
    fmt = PromptFormat(tok)
    sample = generate_samples(args.task, fmt, args.length, 1)[0]
    prefix, suffix = fmt.encode(sample)
    ids = torch.cat([prefix, suffix], dim=-1)
    runs: list[dict] = []
    for rep in range(args.repeats):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            clock = Clock()
            start, cpu0 = time.perf_counter(), time.process_time()
            kvtrim.generate(model, ids, kvtrim.FullCache(), max_new_tokens=args.tokens, prefill_chunk_size=None,
                            logits_processor=LogitsProcessorList([clock]), min_new_tokens=args.tokens)
            end, cpu1 = time.perf_counter(), time.process_time()
            steps = len(clock.wall) - 1
            run = {"repeat": rep, "threads": threads, "prompt_tokens": ids.shape[-1],
                   "prefill_s": round(clock.wall[0] - start, 3), "prefill_cpu_s": round(clock.cpu[0] - cpu0, 3),
                   "decode_s_per_token": round((end - clock.wall[0]) / steps, 4),
                   "decode_cpu_s_per_token": round((cpu1 - clock.cpu[0]) / steps, 4),
                   "load_avg_1min": round(os.getloadavg()[0], 2)}
            runs.append(run)
            print(json.dumps(run), flush=True)
            write(args, runs)  # after every run: an interrupted measurement keeps what it has
    torch.set_num_threads(1)
    print(json.dumps(summarize(args, runs), indent=1))


def summarize(args, runs: list[dict]) -> dict:
    def med(threads: int, key: str) -> float | None:
        values = [r[key] for r in runs if r["threads"] == threads]
        return statistics.median(values) if values else None

    summary = {
        "model": args.model, "task": args.task, "length": args.length, "tokens": args.tokens, "cpus": os.cpu_count(),
        "decode_s_per_token": {t: med(t, "decode_s_per_token") for t in (1, 2)},
        "decode_cpu_s_per_token": {t: med(t, "decode_cpu_s_per_token") for t in (1, 2)},
        "prefill_s": {t: med(t, "prefill_s") for t in (1, 2)},
        "load_avg_1min": [r["load_avg_1min"] for r in runs],
    }
    if med(1, "prefill_s") and med(2, "prefill_s"):
        summary["decode_speedup_2_threads"] = round(med(1, "decode_s_per_token") / med(2, "decode_s_per_token"), 3)
        summary["prefill_speedup_2_threads"] = round(med(1, "prefill_s") / med(2, "prefill_s"), 3)
    return summary


def write(args, runs: list[dict]) -> None:
    pathlib.Path(args.out).write_text(json.dumps({"summary": summarize(args, runs), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
