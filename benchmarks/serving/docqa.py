"""The document-QA load (issue 48, item 4): documents of ~`--doc-tokens` tokens, several needle questions each,
arriving over time, on a pool that holds few full documents; vLLM's prefix caching on in every server.

    .venv-serve/bin/python benchmarks/serving/docqa.py --out benchmarks/serving/results-docqa

Each document is filler text with `--questions` needles ("The pass key of door J is K."); question J asks for
door J's key. A request's prompt is its document's tokens, then its question's (sent as token ids, so the
document is the same tokens in every request). Questions arrive every `--interval` seconds, round robin over
the documents: every document's first question, then every second one, ... Configurations: plain vLLM, and
`kvtrim serve` whose requests name their document as a context compressed on its own (`vllm_xargs:
{"kvtrim": SPEC, "kvtrim_context": document tokens}`) by each of `--methods`. Reported per configuration: time
to first token of first and later questions (p50/p90), output throughput, prompt tokens computed (prompt tokens
less vLLM's prefix-cache hits), later questions that found their document cached (vLLM: its full blocks in
the prefix cache; kvtrim: its compressed context, shared, `kvtrim.vllm.contexts`, per each response's
`cached_tokens`), documents held at once (kvtrim: the most shared contexts its log reports; vLLM: how many full
documents its pool holds), running requests at once, KV-cache usage, preemptions and accuracy (the key in the
answer).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import pathlib
import re
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))  # this checkout's kvtrim (the servers get it too)

import httpx  # noqa: E402
import openai  # noqa: E402
from docqa_docs import FILLER, documents  # noqa: E402
from launch import Server  # noqa: E402
from load import GAUGES, fetch_metrics, parse_metrics, warm_up  # noqa: E402
from run import machine, slug  # noqa: E402

BLOCK = 128  # the servers' KV block (vLLM's CPU default)
COUNTERS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
            "vllm:num_preemptions_total")



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="docqa.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", type=pathlib.Path, required=True, help="results folder (results.json, results.md, logs/)")
    p.add_argument("--methods", default="lagkv:compression_ratio=0.75,keydiff:compression_ratio=0.75",
                   help="comma-separated kvtrim specs, each compressing the documents as contexts")
    p.add_argument("--no-plain", action="store_true", help="skip plain vLLM")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--questions", type=int, default=5, help="questions (needles) per document")
    p.add_argument("--doc-tokens", type=int, default=3000)
    p.add_argument("--blocks", type=int, default=80, help="the KV pool in blocks of 128 (default 80: 3 documents)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between two questions' arrivals")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def _one(client, model, prompt_ids, xargs, max_tokens, send_at, t0):
    await asyncio.sleep(max(0.0, t0 + send_at - time.perf_counter()))
    sent, first, parts, error, cached = time.perf_counter(), None, [], None, None
    try:
        stream = await client.completions.create(model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"vllm_xargs": xargs} if xargs else None)
        async for chunk in stream:
            if chunk.choices:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].text or "")
            if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
    except (openai.OpenAIError, httpx.HTTPError) as e:
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    return {"sent_s": sent - t0, "ttft_s": None if first is None else first - sent,
            "end_s": time.perf_counter() - t0, "text": "".join(parts), "error": error, "cached_tokens": cached}


async def _poll(url, stop, out):
    async with httpx.AsyncClient(timeout=5) as c:
        while not stop.is_set():
            try:
                m = parse_metrics((await c.get(url + "/metrics")).text, GAUGES)
                out.append([m.get(g) for g in GAUGES])
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


async def _load(url, jobs, max_tokens):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    samples, stop, t0 = [], asyncio.Event(), time.perf_counter()
    poller = asyncio.create_task(_poll(url, stop, samples))
    try:
        records = await asyncio.gather(*(_one(client, model, ids, xargs, max_tokens, at, t0)
                                         for ids, xargs, at in jobs))
    finally:
        stop.set()
        await poller
        await client.close()
    return records, samples


def _pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return None if not xs else xs[min(len(xs) - 1, int(q * len(xs)))]


def run_config(args, label, spec, docs, out) -> dict:
    flags = ["--num-gpu-blocks-override", str(args.blocks), "--max-num-seqs", "64", "--dtype", "bfloat16",
             "--enforce-eager", "--max-model-len", "4096", "--seed", str(args.seed), "--enable-prompt-tokens-details"]
    server = Server(args.model, None if spec is None else "full", flags, out / "logs" / f"{slug(label)}.log",
                    prefix_caching=True)
    try:
        jobs, meta = [], []
        for q in range(args.questions):
            for d, (doc, qs) in enumerate(docs):
                ids = doc + qs[q][0]
                xargs = None if spec is None else {"kvtrim": spec, "kvtrim_context": len(doc)}
                jobs.append((ids, xargs, len(jobs) * args.interval))
                meta.append((d, q, qs[q][1]))
        warm_up(server.url, FILLER * 4)  # (one-off costs of a fresh server stay out of the load)
        before = parse_metrics(fetch_metrics(server.url), COUNTERS)
        records, samples = asyncio.run(_load(server.url, jobs, args.max_tokens))
        after = parse_metrics(fetch_metrics(server.url), COUNTERS)
    finally:
        server.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS}
    for r, (d, q, key) in zip(records, meta):
        full = len(docs[d][0]) // BLOCK * BLOCK  # its document's full blocks: what a hit covers at least
        r.update(doc=d, question=q, found=key in r["text"], doc_cached=(r["cached_tokens"] or 0) >= full)
    said = re.findall(r"(\d+) shared contexts hold", server.log_path.read_text())
    per_doc = -(-max(len(doc) + len(qs[0][0]) for doc, qs in docs) // BLOCK)  # a document and a question, in blocks
    first = [r["ttft_s"] for r in records if r["question"] == 0]
    later = [r["ttft_s"] for r in records if r["question"] > 0]
    window = max(r["end_s"] for r in records) - min(r["sent_s"] for r in records)
    return {"label": label, "method": spec, "requests": len(records), "errors": sum(bool(r["error"]) for r in records),
            "ttft_first_p50_s": _pct(first, 0.5), "ttft_first_p90_s": _pct(first, 0.9),
            "ttft_later_p50_s": _pct(later, 0.5), "ttft_later_p90_s": _pct(later, 0.9),
            "output_tok_s": delta["vllm:generation_tokens_total"] / window, "window_s": window,
            "prompt_tokens": delta["vllm:prompt_tokens_total"], "cache_hit_tokens": delta["vllm:prefix_cache_hits_total"],
            "prompt_tokens_computed": delta["vllm:prompt_tokens_total"] - delta["vllm:prefix_cache_hits_total"],
            "preempted": delta["vllm:num_preemptions_total"],
            "running_max": max((s[0] or 0 for s in samples), default=None),
            "running_mean": statistics.mean(s[0] or 0 for s in samples) if samples else None,
            "kv_usage_max": max((s[2] or 0 for s in samples), default=None),
            "later_doc_cached": sum(r["doc_cached"] for r in records if r["question"] > 0), "later": len(later),
            "docs_held": max(map(int, said), default=0) if spec is not None else args.blocks // per_doc,
            "found": sum(r["found"] for r in records), "records": records, "start_s": server.start_s}


def write(out: pathlib.Path, data: dict) -> None:
    (out / "results.json").write_text(json.dumps(data, indent=1))
    c = data["config"]
    lines = ["# Document-QA load: plain vLLM vs `kvtrim serve` with compressed contexts (prefix caching on in both)", "",
             f"{c['docs']} documents of ~{c['doc_tokens_measured']} tokens, {c['questions']} questions each "
             f"(one every {c['interval']} s, round robin), {c['max_tokens']} output tokens, {c['blocks']} KV blocks of "
             f"128; kvtrim {data['machine']['kvtrim_commit'][:10]}, {data['started']}.", "",
             "    " + data["command"], "",
             "| configuration | TTFT first p50 / p90 s | TTFT later p50 / p90 s | out tok/s | prompt tokens computed | "
             "cache hits | later questions finding their document | documents held at once | running max / mean | "
             "KV usage max | preempted | found |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda x, n=2: "–" if x is None else f"{x:.{n}f}"  # noqa: E731
    for r in data["runs"]:
        lines.append(f"| {r['label']} | {f(r['ttft_first_p50_s'])} / {f(r['ttft_first_p90_s'])} | "
                     f"{f(r['ttft_later_p50_s'])} / {f(r['ttft_later_p90_s'])} | {f(r['output_tok_s'], 1)} | "
                     f"{r['prompt_tokens_computed']:.0f} of {r['prompt_tokens']:.0f} | {r['cache_hit_tokens']:.0f} | "
                     f"{r['later_doc_cached']}/{r['later']} | {r['docs_held']}{'' if r['method'] else ' (pool)'} | "
                     f"{f(r['running_max'], 0)} / {f(r['running_mean'], 1)} | {f(r['kv_usage_max'])} | "
                     f"{r['preempted']:.0f} | {r['found']}/{r['requests']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.model), local_files_only=True)
    docs = documents(tok, args.docs, args.questions, args.doc_tokens, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"config": {"docs": args.docs, "questions": args.questions, "doc_tokens": args.doc_tokens,
                       "doc_tokens_measured": round(statistics.mean(len(d) for d, _ in docs)),
                       "blocks": args.blocks, "interval": args.interval, "max_tokens": args.max_tokens,
                       "seed": args.seed, "model": args.model},
            "machine": machine(), "command": " ".join(["benchmarks/serving/docqa.py", *(argv or sys.argv[1:])]),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "runs": []}
    configs = ([] if args.no_plain else [("vllm", None)]) + [(m, m) for m in args.methods.split(",") if m]
    for label, spec in configs:
        print(f"[{label}] ...", flush=True)
        run = run_config(args, label, spec, docs, args.out)
        data["runs"].append(run)
        write(args.out, data)
        print(f"[{label}] TTFT first p50 {run['ttft_first_p50_s']:.2f} s, later p50 {run['ttft_later_p50_s']:.2f} s, "
              f"{run['output_tok_s']:.1f} out tok/s, computed {run['prompt_tokens_computed']:.0f} of "
              f"{run['prompt_tokens']:.0f} prompt tokens, found {run['found']}/{run['requests']}, "
              f"{run['errors']} errors", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
