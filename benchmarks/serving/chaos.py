"""The chaos load: no request may stop the engine (issue 61).

Concurrent clients send, for `--minutes`, a mix of everything a server meets: every servable method (prompt-end,
block-wise, decode-time), questions about shared documents (`kvtrim_context`), bursts of questions about one document
sent at the same moment (their contexts end in the same step), more documents than the pool holds at once (LRU
release), long generations that grow (preemption under `--admission vllm`), clients that go away mid-prefill and
mid-decode, bad specs, and installed methods that raise in each hook (`score`, `schedule`, `repr`, `on_attention`:
tests/data/contract_breaker). vLLM's prefix caching is on.

A phase is one server (`PHASES`); after its load it must: answer a request, have answered every request with a 200
or an error in one line (no connection refused or reset), hold no block but those of the shared contexts it reports,
hold no request in kvtrim's scheduler or worker maps and no context in the worker that the scheduler does not hold
(the idle lines they log), have an RSS at the end within 5 % of the RSS after its warm-up, and have no traceback in
its log. The summary (`summary.json`, `summary.md`) says so, with requests by kind and outcome; the servers' logs
go to `OUT/logs/` (not committed).

    .venv-serve/bin/python benchmarks/serving/chaos.py --out benchmarks/serving/results-chaos \
        --phases tp1,tp1-vllm,tp2 --minutes 9,6,6

`run_load` is also what `make test` runs for a minute against its own server (tests/test_vllm_server.py).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import random
import re
import sys
import threading
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
BREAKER = HERE.parents[1] / "tests" / "data" / "contract_breaker"
sys.path.append(str(BREAKER))  # (its methods' specs are read here too: `expected`)

#: name -> the server: model, tensor-parallel ranks, admission, pool blocks (128 tokens each), max_model_len
PHASES = {
    "tp1": dict(model="smollm2-135m", tp=1, admission="peak", blocks=48, max_len=2048),
    "tp1-vllm": dict(model="smollm2-135m", tp=1, admission="vllm", blocks=24, max_len=2048),
    "tp2": dict(model="qwen2.5-coder-0.5b", tp=2, admission="peak", blocks=48, max_len=2048),
}

#: the servable methods a request picks (`vllm_xargs.kvtrim`): (spec, max new tokens: decode-time ones decode more)
METHODS = [("full", 12), ("lagkv:compression_ratio=0.5", 12), ("keydiff:compression_ratio=0.75", 12),
           ("keydiff:budget=96:block_size=64", 48), ("streaming:budget=80", 64), ("knorm:compression_ratio=0.5", 8),
           ("snapkv:compression_ratio=0.5", 8), ("snapkv:budget=64:window=8:block_size=64", 8),
           ("tova:budget=64", 48), ("h2o:budget=64", 48), ("lazyeviction:budget=64:window=8", 64),
           ("lagkv:lag_size=32:keep_ratio=0.25", 64)]
#: methods whose compressed contexts requests share (the document questions)
SHARED = ["lagkv:compression_ratio=0.75", "keydiff:compression_ratio=0.5", "snapkv:compression_ratio=0.5"]
#: bad requests: (xargs, what the 400 says)
BAD = [({"kvtrim": "lagkv:compression_ratio=2"}, "compression_ratio"), ({"kvtrim": "nosuch"}, "unknown method"),
       ({"kvtrim": "keydiff:compression_ratio=0.5", "kvtrim_context": 100000}, "past the prompt's end"),
       ({"kvtrim": "kvzip:compression_ratio=0.5"}, "not supported inside vLLM")]
#: installed methods that raise (tests/data/contract_breaker): spec -> the status their requests get
BREAKERS = {"raises_in_score:compression_ratio=0.5": 500, "raises_in_schedule:budget=32": 400,
            "raises_in_repr:compression_ratio=0.5": 400, "raises_in_on_attention:budget=48": 500}
#: job kinds and their weights
KINDS = {"method": 40, "document": 20, "burst": 4, "grow": 6, "abort_prefill": 5, "abort_decode": 5, "bad": 5,
         "breaker": 5}
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards hex bold jugglers near quiet rivers and "
         "ancient stone bridges under pale winter skies").split()


def text(rng: random.Random, words: int) -> str:
    start = rng.randrange(len(WORDS))
    return " ".join(WORDS[(start + 3 * i + i // 7) % len(WORDS)] for i in range(words))


def expected(spec: str, status: int, tensor_parallel: int) -> int:
    """The status a request of `spec` gets from a server of `tensor_parallel` ranks: 400 for a method refused there
    (one deciding from all of a layer's heads: TOVA), else `status`."""
    if tensor_parallel == 1:
        return status
    from kvtrim.vllm.spec import method_for_vllm, parallel_refusal

    return 400 if parallel_refusal(method_for_vllm(spec), tensor_parallel) else status


class Load:
    """The jobs of one load against `url` and their outcomes (thread-safe)."""

    def __init__(self, url: str, tokenizer, seed: int = 0, documents: int = 10, tensor_parallel: int = 1):
        import httpx
        import openai

        self.url, self.openai = url, openai
        # a new connection per request: a kept-alive one can be closed by the server as the client reuses it (a
        # client-side race, seen once in 2,025 requests: no response was lost by the server)
        http = openai.DefaultHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0))
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600,
                                    http_client=http)
        self.model = self.client.models.list().data[0].id
        rng = random.Random(seed)
        # documents of 300-700 tokens (as token ids: their length is the context's) and questions about them
        self.docs = [tokenizer(f"Document {d}. " + text(rng, rng.randrange(220, 520))).input_ids
                     for d in range(documents)]
        self.questions = [tokenizer(f" Question {q}: what comes after {text(rng, 3)}?", add_special_tokens=False).input_ids
                          for q in range(12)]
        self.outcomes: collections.Counter = collections.Counter()  # (kind, outcome) -> requests
        self.problems: list[str] = []  # what should not have happened (first 50)
        self.lock = threading.Lock()
        self.seed, self.tensor_parallel = seed, tensor_parallel

    def note(self, kind: str, outcome: str, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[kind, outcome] += 1
            if problem and len(self.problems) < 50:
                self.problems.append(f"{kind}: {problem}")

    def send(self, kind: str, prompt, max_tokens: int, xargs: dict | None, expect: int = 200, stream_chunks=None,
             timeout: float | None = None, salt: str | None = None) -> None:
        """One completion; `expect`: the status it must get; `stream_chunks`: close the stream after that many chunks
        (a client going away mid-decode); `timeout`: give up after that many seconds (mid-prefill); `salt`: vLLM's
        `cache_salt` (part of a shared context's key)."""
        openai = self.openai
        client = self.client if timeout is None else self.client.with_options(timeout=timeout)
        body = ({"ignore_eos": True} | ({"vllm_xargs": xargs} if xargs else {})
                | ({"cache_salt": salt} if salt else {}))
        try:
            if stream_chunks is not None:
                stream = client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True, extra_body=body)
                for i, _ in enumerate(stream):
                    if i + 1 >= stream_chunks:
                        break
                stream.close()
                return self.note(kind, "aborted", None if expect == 200 else f"streamed, expected {expect}")
            r = client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body=body)
            ok = expect == 200 and r.usage.completion_tokens == max_tokens
            self.note(kind, "200", None if ok else f"200 with {r.usage.completion_tokens} tokens, expected {expect}")
        except openai.APITimeoutError:
            self.note(kind, "aborted" if timeout is not None else "timeout",
                      None if timeout is not None else "timed out")
        except openai.APIStatusError as err:
            message = str(getattr(err, "message", err))
            one_line = "\n" not in message
            self.note(kind, str(err.status_code), None if err.status_code == expect and one_line
                      else f"{err.status_code} (expected {expect}): {message[:200]!r}")
        except openai.APIConnectionError as err:
            self.note(kind, "connection error", f"{type(err).__name__}: {err} ({err.__cause__!r})")
        except openai.APIError as err:  # an error event in a stream (vLLM checks a streamed request in the stream)
            message = str(getattr(err, "message", err))
            self.note(kind, "stream error", None if expect >= 400 and "\n" not in message else f"{err}"[:200])

    def expect(self, spec: str, status: int = 200) -> int:
        return expected(spec, status, self.tensor_parallel)

    def job(self, rng: random.Random) -> None:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if kind == "method":
            spec, new = rng.choice(METHODS)
            self.send(kind, text(rng, rng.randrange(20, 300)), rng.randrange(1, new + 1), {"kvtrim": spec},
                      expect=self.expect(spec))
        elif kind == "document":
            d, spec = rng.randrange(len(self.docs)), rng.choice(SHARED)
            self.send(kind, self.docs[d] + rng.choice(self.questions), rng.randrange(1, 12),
                      {"kvtrim": spec, "kvtrim_context": len(self.docs[d])})
        elif kind == "burst":  # 8 questions about one document at the same moment: their contexts end in one step
            d, spec = rng.randrange(len(self.docs)), rng.choice(SHARED)
            salt = f"burst {rng.random()}"  # (a fresh key: nothing registered yet)
            xargs = {"kvtrim": spec, "kvtrim_context": len(self.docs[d])}
            barrier = threading.Barrier(8)

            def one(q):
                barrier.wait()
                self.send(kind, self.docs[d] + self.questions[q], 4, xargs, salt=salt)

            with concurrent.futures.ThreadPoolExecutor(8) as burst:
                list(burst.map(one, range(8)))
        elif kind == "grow":  # long generations: the pool runs out, vLLM preempts (--admission vllm)
            spec = rng.choice(["full", "keydiff:compression_ratio=0.5", "streaming:budget=80", "tova:budget=64",
                               "lagkv:compression_ratio=0.5"])
            self.send(kind, text(rng, rng.randrange(200, 600)), rng.randrange(150, 400), {"kvtrim": spec},
                      expect=self.expect(spec))
        elif kind == "abort_prefill":
            spec = rng.choice(METHODS)[0]
            self.send(kind, text(rng, rng.randrange(900, 1500)), 16, {"kvtrim": spec}, timeout=rng.uniform(0.1, 1.0),
                      expect=self.expect(spec))
        elif kind == "abort_decode":
            spec = rng.choice(METHODS)[0]
            self.send(kind, text(rng, rng.randrange(50, 300)), 200, {"kvtrim": spec}, stream_chunks=rng.randrange(1, 8),
                      expect=self.expect(spec))
        elif kind == "bad":
            xargs, _ = rng.choice(BAD)
            self.send(kind, text(rng, 30), 4, xargs, expect=400)
        else:
            spec = rng.choice(list(BREAKERS))
            self.send(kind, text(rng, rng.randrange(60, 200)), 12, {"kvtrim": spec}, expect=self.expect(spec, BREAKERS[spec]))


def run_load(url: str, tokenizer, seconds: float, clients: int = 12, seed: int = 0,
             every=None, every_s: float = 60.0, tensor_parallel: int = 1) -> Load:
    """`clients` threads send jobs for `seconds` to a server of `tensor_parallel` ranks; `every(seconds so far)` is
    called every `every_s` seconds meanwhile. Returns the load with its outcomes."""
    load = Load(url, tokenizer, seed, tensor_parallel=tensor_parallel)
    start = time.monotonic()
    end = start + seconds

    def client(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        while time.monotonic() < end:
            load.job(rng)

    with concurrent.futures.ThreadPoolExecutor(clients) as threads:
        futures = [threads.submit(client, c) for c in range(clients)]
        if every is not None:
            due = start + every_s
            while not all(f.done() for f in futures):
                if time.monotonic() >= due:
                    every(time.monotonic() - start)
                    due += every_s
                time.sleep(1)
        for f in futures:
            f.result()
    return load


def gauges(url: str) -> dict[str, float]:
    from load import parse_metrics

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode(), ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"))


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(url)
        if g.get("vllm:num_requests_running", 0) == 0 and g.get("vllm:num_requests_waiting", 0) == 0:
            return g
        if time.monotonic() > deadline:
            return g
        time.sleep(1)


IDLE_SCHEDULER = re.compile(r"kvtrim: scheduler idle: (\d+) requests, (\d+) failed to end, (\d+) shared contexts hold "
                            r"(\d+) blocks, (\d+) pending, (\d+) of (\d+) blocks free")
IDLE_WORKER = re.compile(r"\((?:Worker\S*) pid=(\d+)\).*kvtrim: worker idle: (\d+) requests, (\d+) shared contexts, "
                         r"(\d+) query windows held")


def held(log: str) -> dict:
    """What kvtrim's scheduler and each worker said they hold when last idle (None where they said nothing)."""
    s = IDLE_SCHEDULER.findall(log)
    workers: dict[str, tuple] = {}
    for pid, *counts in IDLE_WORKER.findall(log):
        workers[pid] = tuple(int(c) for c in counts)
    scheduler = None
    if s:
        requests, failed, contexts, blocks, pending, free, total = (int(x) for x in s[-1])
        scheduler = dict(requests=requests, failed=failed, contexts=contexts, context_blocks=blocks, pending=pending,
                         free=free, total=total)
    return {"scheduler": scheduler, "workers": [dict(requests=r, contexts=c, windows=w) for r, c, w in workers.values()]}


def check_held(h: dict) -> list[str]:
    """What is wrong with what the server holds when idle (`held`)."""
    s, problems = h["scheduler"], []
    if s is None:
        return ["the scheduler never said it was idle"]
    if s["requests"] or s["failed"] or s["pending"]:
        problems.append(f"the scheduler holds {s['requests']} requests, {s['failed']} failed, {s['pending']} pending")
    if s["free"] != s["total"] - s["context_blocks"]:
        problems.append(f"{s['total'] - s['free']} blocks used, the shared contexts hold {s['context_blocks']}")
    if not h["workers"]:
        problems.append("no worker said it was idle")
    for w in h["workers"]:
        if w["requests"] or w["windows"] or w["contexts"] != s["contexts"]:
            problems.append(f"a worker holds {w['requests']} requests, {w['windows']} query windows and {w['contexts']} "
                            f"contexts (the scheduler {s['contexts']})")
    return problems


def rss_kb(pgid: int) -> dict[str, int]:
    """The resident memory (kB) of each process of the server's process group, by its name and pid."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            out[f"{stat[stat.index('(') + 1:stat.rindex(')')]} {pid}"] = kb
        except (OSError, StopIteration, ValueError, IndexError):
            pass
    return out


def run_phase(name: str, minutes: float, clients: int, out: pathlib.Path, seed: int) -> dict:
    from launch import Server
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    cfg = PHASES[name]
    flags = ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(cfg["max_len"]), "--max-num-seqs", "8",
             "--num-gpu-blocks-override", str(cfg["blocks"]), "--seed", "0", "--admission", cfg["admission"],
             "--tensor-parallel-size", str(cfg["tp"])]
    started = time.monotonic()
    server = Server(cfg["model"], "full", flags, out / "logs" / f"{name}.log", prefix_caching=True, ranks=cfg["tp"],
                    path=str(BREAKER))
    try:
        tok = AutoTokenizer.from_pretrained(resolve_model_dir(cfg["model"]), local_files_only=True)
        samples = []  # (seconds into the load, {process: kB}), every half minute
        t0 = time.monotonic()
        load = run_load(server.url, tok, minutes * 60, clients, seed, every_s=30, tensor_parallel=cfg["tp"],
                        every=lambda t: samples.append((round(t), rss_kb(server.proc.pid))))
        seconds = time.monotonic() - t0
        g = wait_idle(server.url)
        answered = True
        try:
            load.client.completions.create(model=load.model, prompt="The capital of France is", max_tokens=4)
        except Exception as err:  # noqa: BLE001
            answered = False
            load.problems.append(f"the server did not answer after the load: {err}")
        wait_idle(server.url)
        time.sleep(2)
        samples.append((round(time.monotonic() - t0), rss_kb(server.proc.pid)))
        log = server.log_text()
    finally:
        server.stop()
    h = held(log)
    problems = list(load.problems) + check_held(h)
    tracebacks = log.count("Traceback (most recent call last)")
    # vLLM's completion stream generator logs with its traceback a request its front end refused inside the stream
    # (kvtrim's 400s: `validate_request` runs there for a streamed request); the client got the error event
    refused_in_stream = len(re.findall(r"Error in completion stream generator\.(?:.|\n)*?VLLMValidationError: kvtrim: ",
                                       log))
    if tracebacks > refused_in_stream:
        problems.append(f"{tracebacks - refused_in_stream} tracebacks in the log")
    # warmed up: the sample a third into the load (allocators and caches grown to the load's working set)
    warm = next((kb for t, kb in samples if t >= seconds / 3), None)
    end_kb = sum(samples[-1][1].values())
    growth = end_kb / sum(warm.values()) - 1 if warm else None
    if growth is None or growth > 0.05:
        problems.append(f"RSS grew by {growth:.1%} after warm-up" if growth is not None else "no RSS after warm-up")
    outcomes = collections.defaultdict(dict)
    for (kind, outcome), n in sorted(load.outcomes.items()):
        outcomes[kind][outcome] = n
    return {"phase": name, **cfg, "minutes": minutes, "clients": clients, "seconds": round(seconds, 1),
            "server_start_s": round(server.start_s, 1), "wall_s": round(time.monotonic() - started, 1),
            "requests": sum(load.outcomes.values()), "outcomes": outcomes, "answered_after": answered,
            "preemptions": g.get("vllm:num_preemptions_total"), "held_when_idle": h,
            "rss_warm_kb": sum(warm.values()) if warm else None, "rss_end_kb": end_kb,
            "rss_growth": None if growth is None else round(growth, 4), "rss_samples": samples,
            "tracebacks": tracebacks, "tracebacks_of_400s_in_streams": refused_in_stream, "shared_contexts_registered": log.count("shares its context"),
            "contexts_released_for_room": sum(int(n) for n in re.findall(r"(\d+) shared contexts released for room", log)),
            "problems": problems, "ok": not problems}


def write(out: pathlib.Path, runs: list[dict], header: dict) -> None:
    (out / "summary.json").write_text(json.dumps({**header, "phases": runs}, indent=1) + "\n")
    lines = [f"# Chaos load ({header['date']}, kvtrim {header['commit']}, {header['cpu']})", "",
             f"Command: `{header['command']}`", "",
             "| phase | model | TP | admission | pool blocks | minutes | requests | preemptions | contexts registered / "
             "released for room | RSS after warm-up -> end (MB) | held when idle | tracebacks | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r["held_when_idle"]["scheduler"] or {}
        lines.append(f"| {r['phase']} | {r['model']} | {r['tp']} | {r['admission']} | {r['blocks']} | "
                     f"{r['seconds'] / 60:.1f} | {r['requests']} | {r['preemptions']:.0f} | "
                     f"{r['shared_contexts_registered']} / {r['contexts_released_for_room']} | "
                     f"{(r['rss_warm_kb'] or 0) / 1024:.0f} -> {r['rss_end_kb'] / 1024:.0f} | "
                     f"{s.get('requests')} requests, {s.get('contexts')} contexts in {s.get('context_blocks')} blocks, "
                     f"{s.get('total', 0) - s.get('free', 0)} blocks used; workers "
                     f"{[(w['requests'], w['contexts']) for w in r['held_when_idle']['workers']]} | {r['tracebacks']} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    lines += ["", "Requests by kind and outcome (status, or `aborted` by the client):", ""]
    for r in runs:
        lines.append(f"* {r['phase']}: " + "; ".join(f"{kind} " + ", ".join(f"{o} {n}" for o, n in outs.items())
                                                     for kind, outs in r["outcomes"].items()))
        samples = r["rss_samples"]
        if samples:
            lines.append(f"  * RSS by process (MB), at {samples[0][0]} s -> a third in -> the end: " + "; ".join(
                f"{name.split()[0]} " + " -> ".join(f"{kb.get(name, 0) / 1024:.0f}" for _, kb in
                                                   (samples[0], next((x for x in samples if x[0] >= r['seconds'] / 3),
                                                                     samples[-1]), samples[-1]))
                for name in samples[-1][1]))
        lines += [f"  * problem: {p}" for p in r["problems"]]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=HERE / "results-chaos")
    p.add_argument("--phases", default="tp1,tp1-vllm,tp2", help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--minutes", default="9,6,6", help="the load's minutes per phase (comma-separated)")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    phases = args.phases.split(",")
    minutes = [float(m) for m in args.minutes.split(",")]
    if len(minutes) != len(phases) or any(ph not in PHASES for ph in phases):
        p.error(f"--phases of {', '.join(PHASES)} and one --minutes value each")
    import datetime
    import subprocess

    args.out.mkdir(parents=True, exist_ok=True)
    flags = open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n")[0] if os.path.exists("/proc/cpuinfo") else ""
    cpu = ("AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else
           "AVX-512" if "avx512f" in flags else "AVX2")
    header = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=HERE).stdout.strip(),
              "cpu": f"{os.cpu_count()} CPUs, {cpu}", "command": " ".join(["chaos.py", *(argv or sys.argv[1:])])}
    runs = []
    for name, m in zip(phases, minutes):
        runs.append(run_phase(name, m, args.clients, args.out, args.seed + len(runs)))
        write(args.out, runs, header)
        print(f"{name}: {runs[-1]['requests']} requests in {runs[-1]['seconds']:.0f} s, ok={runs[-1]['ok']}",
              *runs[-1]["problems"], sep="\n  ", flush=True)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
