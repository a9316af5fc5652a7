"""Calibrate the reasoning tasks on real models with the full cache: accuracy, output length, decode speed.

For each (model, task, length) it generates `--samples` samples (`kvtrim.eval.tasks.generate_samples`,
chat template), answers each greedily with `kvtrim.generate(model, ids, kvtrim.FullCache(), ...)` in
float32, and records the scores (`trace` metric), the number of generated tokens, whether the answer
hit `max_new_tokens`, the prefill time and the decode time per token. One line per sample goes to
`samples.jsonl` at once (a re-run skips what is there, so an interrupted calibration resumes); the
summary goes to `results.json` and `table.md`.

    PYTHONPATH=src .venv/bin/python benchmarks/reasoning/calibrate.py \\
        --models qwen2.5-coder-0.5b --tasks arith_trace,arith_recall,program_trace --lengths 1024 --samples 4

Timings use `--threads` torch threads (2 by default, the CPU this project targets). Wall-clock seconds per
token are as good as the machine's load allows (the 1-minute load average is recorded with each sample);
process CPU seconds per token are recorded too: on an idle machine, wall time per token lies between
CPU/threads (perfect use of the threads) and CPU (none).
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
from kvtrim.decoding import eos_ids
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.scoring import score_prediction
from kvtrim.eval.tasks import REASONING_TASKS, generate_samples

HERE = pathlib.Path(__file__).parent


class StepClock(LogitsProcessor):
    """Records when each step's logits are ready (the first one right after the prefill), in wall-clock
    and in process CPU seconds (the latter stays meaningful on a machine shared with other jobs)."""

    def __init__(self):
        self.times: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())
        return scores


def run_sample(model, tok, fmt: PromptFormat, sample) -> dict:
    prefix, suffix = fmt.encode(sample)
    ids = torch.cat([prefix, suffix], dim=-1)
    clock = StepClock()
    start = time.perf_counter()
    new, _ = kvtrim.generate(model, ids, kvtrim.FullCache(), max_new_tokens=sample.max_new_tokens,
                             prefill_chunk_size=None, logits_processor=LogitsProcessorList([clock]))
    end, cpu_end = time.perf_counter(), time.process_time()
    tokens = new[0].tolist()
    eos = eos_ids(model, tok)
    ended = bool(tokens) and tokens[-1] in eos
    text = tok.decode(tokens, skip_special_tokens=True)
    decode_steps = len(clock.times) - 1  # forwards of one generated token each
    return {
        "sample_id": sample.id, "task": sample.task, "length": sample.length, "steps": sample.meta["steps"],
        "prompt_tokens": ids.shape[-1], "reference_tokens": sample.meta["reference_tokens"],
        "max_new_tokens": sample.max_new_tokens, "new_tokens": len(tokens) - int(ended),
        "hit_max_new_tokens": not ended and len(tokens) >= sample.max_new_tokens,
        "prefill_s": round(clock.times[0] - start, 3),
        "decode_s_per_token": round((end - clock.times[0]) / decode_steps, 4) if decode_steps else None,
        "decode_cpu_s_per_token": round((cpu_end - clock.cpu[0]) / decode_steps, 4) if decode_steps else None,
        "load_avg_1min": round(os.getloadavg()[0], 2),
        **score_prediction(sample.metric, text, sample.answers), "prediction": text,
    }


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["task"], r["length"]), []).append(r)
    out = []
    for (model, task, length), g in sorted(groups.items()):
        lengths = [r["new_tokens"] for r in g]
        speeds = [r["decode_s_per_token"] for r in g if r["decode_s_per_token"]]
        cpu = [r["decode_cpu_s_per_token"] for r in g if r["decode_cpu_s_per_token"]]
        out.append({
            "model": model, "task": task, "length": length, "n": len(g),
            "steps": statistics.median(r["steps"] for r in g),
            "accuracy": round(statistics.mean(r["score"] for r in g), 3),
            "trace_partial": round(statistics.mean(r["trace_partial"] for r in g), 3),
            "hit_max_new_tokens": sum(r["hit_max_new_tokens"] for r in g),
            "prompt_tokens": round(statistics.median(r["prompt_tokens"] for r in g)),
            "output_tokens_p10": _pct(lengths, 0.1), "output_tokens_p50": _pct(lengths, 0.5),
            "output_tokens_p90": _pct(lengths, 0.9),
            "output_vs_reference": round(statistics.median(r["new_tokens"] / r["reference_tokens"] for r in g), 2),
            "decode_s_per_token": round(statistics.median(speeds), 4) if speeds else None,
            "decode_cpu_s_per_token": round(statistics.median(cpu), 4) if cpu else None,
            "load_avg_1min": round(statistics.median(r["load_avg_1min"] for r in g), 1),
            "prefill_s": round(statistics.median(r["prefill_s"] for r in g), 2),
        })
    return out


def table(summary: list[dict]) -> str:
    head = ("| model | task | length | steps | n | accuracy | step values right | hit cap | prompt tok | "
            "output tok p10 / p50 / p90 | output / reference | decode s/token (wall) | decode CPU s/token | load |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summary:
        lines.append(
            f"| {s['model']} | {s['task']} | {s['length']} | {s['steps']:g} | {s['n']} | {100 * s['accuracy']:.0f} % | "
            f"{100 * s['trace_partial']:.0f} % | {s['hit_max_new_tokens']} | {s['prompt_tokens']} | "
            f"{s['output_tokens_p10']} / {s['output_tokens_p50']} / {s['output_tokens_p90']} | "
            f"{s['output_vs_reference']} | {s['decode_s_per_token']} | {s['decode_cpu_s_per_token']} | "
            f"{s['load_avg_1min']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen2.5-coder-0.5b")
    p.add_argument("--tasks", default=",".join(REASONING_TASKS))
    p.add_argument("--lengths", default="1024", help="target lengths in tokens (prompt + max_new_tokens)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(HERE))
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "samples.jsonl"
    rows = [json.loads(line) for line in path.open()] if path.exists() else []
    done = {(r["model"], r["sample_id"]) for r in rows}
    for model_name in args.models.split(","):
        model = tok = None
        for task in args.tasks.split(","):
            for length in map(int, args.lengths.split(",")):
                if model is None:
                    torch.set_num_threads(1)
                    model, tok = kvtrim.load_model(model_name, dtype=torch.float32)
                    fmt = PromptFormat(tok)
                for sample in generate_samples(task, fmt, length, args.samples, seed=args.seed):
                    if (model_name, sample.id) in done:
                        continue
                    torch.set_num_threads(args.threads)
                    row = {"model": model_name, "threads": args.threads, **run_sample(model, tok, fmt, sample)}
                    torch.set_num_threads(1)
                    rows.append(row)
                    with path.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{model_name} {sample.id}: score {row['score']:.0f} steps right {row['trace_partial']:.2f} "
                          f"{row['new_tokens']} tokens ({row['reference_tokens']} ideal) "
                          f"{row['decode_s_per_token']} s/token", flush=True)
    summary = summarize(rows)
    (out / "results.json").write_text(json.dumps({"summary": summary}, indent=1) + "\n")
    (out / "table.md").write_text(table(summary))
    print(table(summary))


if __name__ == "__main__":
    main()
