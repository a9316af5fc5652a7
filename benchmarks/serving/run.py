"""Serving benchmark (issue 24, item 4): plain vLLM against `kvtrim serve` under one concurrent load.

    .venv-serve/bin/python benchmarks/serving/run.py --out benchmarks/serving/results      # or: make bench-serving
    .venv-serve/bin/python benchmarks/serving/run.py --out /tmp/smoke --requests 4 --prompt-tokens 600 \
        --max-tokens 16 --methods full,lagkv:compression_ratio=0.5                           # a small check

One server at a time, each with the same small KV pool (`--num-gpu-blocks-override`): plain vLLM (its own
worker), then `kvtrim serve --method M` for each of `--methods`. Each gets one warm-up request, then all
`--requests` passkey prompts at once (streamed, greedy, `ignore_eos`, exactly `--max-tokens` each) while
`/metrics` is polled. Writes OUT/results.json after every configuration (`--resume` skips those already
there), OUT/results.md, OUT/serving.png and the server logs under OUT/logs/. See README.md here.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's kvtrim (the servers get it too: launch.server_env)

DEFAULT_METHODS = ("full,lagkv:compression_ratio=0.5,lagkv:compression_ratio=0.75,"
                   "keydiff:compression_ratio=0.5,keydiff:compression_ratio=0.75")
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 128  # vLLM's CPU backend; the measured one is recorded from /metrics (cache_config_info)
PLAIN = "vllm"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        print(f"run.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="run.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", type=pathlib.Path, required=True,
                   help="results folder (results.json, results.md, serving.png, logs/)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated kvtrim method specs, one `kvtrim serve --method` each "
                        f"(default: {DEFAULT_METHODS})")
    p.add_argument("--no-plain", action="store_true", help="skip the plain vLLM reference")
    p.add_argument("--model", default="smollm2-135m", help="a name of `kvtrim models` (default smollm2-135m)")
    p.add_argument("--blocks", type=int, default=100,
                   help="KV blocks of every server (--num-gpu-blocks-override; default 100)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's --max-num-seqs (default 64)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM's --tensor-parallel-size for every server (default 1; the ranks' threads bound apart)")
    p.add_argument("--requests", type=int, default=24, help="concurrent requests, all sent at once (default 24)")
    p.add_argument("--prompt-tokens", type=int, default=3000, help="passkey prompt length in tokens (default 3000)")
    p.add_argument("--max-tokens", type=int, default=256, help="output tokens per request (default 256)")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                   help=f"vLLM's --max-model-len of every server (default {MAX_MODEL_LEN})")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="vLLM's --dtype of every server (default bfloat16; float32 on a CPU without native bfloat16, "
                        "where torch emulates bfloat16 matrix products)")
    p.add_argument("--seed", type=int, default=0, help="passkey keys and vLLM's --seed (default 0)")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between /metrics polls (default 0.5)")
    p.add_argument("--resume", action="store_true", help="keep the configurations already in OUT/results.json "
                                                          "(same settings), run only the others")
    p.add_argument("--server-timeout", type=float, default=900, help="seconds a server may take to start (default 900)")
    args = p.parse_args(argv)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors before any server starts."""
    import importlib.util

    for mod in ("vllm", "openai", "httpx"):
        if importlib.util.find_spec(mod) is None:
            p.error(f"{mod} is not importable: run this from .venv-serve (make serve-env)")
    from kvtrim.methods.base import KvtrimError
    from kvtrim.vllm.spec import method_for_vllm

    for name, lo in (("blocks", 1), ("max_num_seqs", 1), ("requests", 1), ("prompt_tokens", 16), ("max_tokens", 1)):
        if getattr(args, name) < lo:
            p.error(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(args, name)}")
    if args.poll <= 0:
        p.error(f"--poll must be > 0, got {args.poll}")
    if args.prompt_tokens + args.max_tokens > args.max_model_len:
        p.error(f"--prompt-tokens + --max-tokens must fit --max-model-len {args.max_model_len}, "
                f"got {args.prompt_tokens + args.max_tokens}")
    args.plain_refused = None
    need = -(-args.max_model_len // BLOCK_SIZE) + 1  # vLLM keeps one block of the pool aside (its null block)
    if args.blocks < need and not args.no_plain:  # the long-prompt load shows it: recorded, the others still run
        args.plain_refused = (f"plain vLLM needs one request of --max-model-len {args.max_model_len} to fit in "
                              f"--blocks {args.blocks} ({need} blocks of {BLOCK_SIZE}): it will refuse to start")
    if not args.method_list and args.no_plain:
        p.error("nothing to run: --methods is empty and --no-plain is set")
    if len(set(args.method_list)) != len(args.method_list):
        p.error(f"--methods lists a spec twice: {args.methods}")
    from kvtrim.vllm.planning import longest_peak

    for spec in args.method_list:
        try:
            method = method_for_vllm(spec)
        except KvtrimError as e:
            p.error(f"--methods: {e}")
        peak = longest_peak(method, args.max_model_len)  # what kvtrim's KV-cache spec asks vLLM's start-up check for
        if args.blocks < -(-peak // BLOCK_SIZE) + 1:
            p.error(f"--blocks {args.blocks}: under {spec} one request of --max-model-len {args.max_model_len} may hold "
                    f"{peak} entries: use --blocks >= {-(-peak // BLOCK_SIZE) + 1}")
    from kvtrim.models import MODELS

    if args.model not in MODELS and not pathlib.Path(args.model).is_dir():
        p.error(f"--model must be a name of `kvtrim models` ({', '.join(sorted(MODELS))}) or a model directory, "
                f"got {args.model!r}")


def vllm_flags(args) -> list[str]:
    return ["--num-gpu-blocks-override", str(args.blocks), "--max-num-seqs", str(args.max_num_seqs),
            "--dtype", args.dtype, "--enforce-eager", "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
            *(["--tensor-parallel-size", str(args.tensor_parallel_size)] if args.tensor_parallel_size > 1 else [])]


def config_of(args, samples) -> dict:
    import launch

    n = [s.n_tokens for s in samples]
    return {"model": args.model, "blocks": args.blocks, "max_num_seqs": args.max_num_seqs, "requests": args.requests,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "seed": args.seed, "poll_s": args.poll,
            "vllm_flags": vllm_flags(args),
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": launch.thread_binding(args.tensor_parallel_size)},
            "prompt_tokens_measured": {"min": min(n), "max": max(n), "mean": sum(n) / len(n)}}


def machine() -> dict:
    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    def git(*cmd):
        r = subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "vllm": version("vllm-cpu") or version("vllm"),
            "transformers": version("transformers"), "openai": version("openai"),
            "kvtrim_commit": git("rev-parse", "HEAD"), "kvtrim_dirty": bool(git("status", "--porcelain", "--", "src")),
            "loadavg_start": list(os.getloadavg())}


def _dtype(config: dict) -> str:
    """The servers' dtype as their flags said it (results from before `--dtype`: bfloat16)."""
    flags = config.get("vllm_flags", [])
    return flags[flags.index("--dtype") + 1] if "--dtype" in flags else "bfloat16"


def _commits_line(runs: list[dict]) -> list[str]:
    """One line naming each configuration's kvtrim commit when `--resume` ran them at different commits."""
    commits = {r["label"]: (r.get("kvtrim_commit") or "?")[:10] for r in runs}
    if len(set(commits.values())) < 2:
        return []
    return ["Configurations at different kvtrim commits (`--resume`): "
            + ", ".join(f"{label} {c}" for label, c in commits.items()) + ".\n"]


def _num(x) -> str:
    return "–" if x is None else f"{x:.1f}"


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-")


def run_one(args, label: str, method: str | None, samples, out: pathlib.Path) -> dict:
    """One server: start, warm up, load, stop; its record for results.json."""
    from launch import Server
    from load import COUNTERS, cache_info, fetch_metrics, parse_metrics, run_load, warm_up
    from report import eviction_share, last_stats, stats_delta, summarize

    record = {"label": label, "server": "vllm" if method is None else "kvtrim serve", "method": method,
              "loadavg_before": list(os.getloadavg())}
    print(f"[{label}] starting the server ...", flush=True)
    server = Server(args.model, method, vllm_flags(args), out / "logs" / f"{slug(label)}.log", args.server_timeout,
                    ranks=args.tensor_parallel_size)
    try:
        record["server_start_s"] = server.start_s
        print(f"[{label}] up in {server.start_s:.0f} s; warm-up, then {args.requests} requests", flush=True)
        warm_up(server.url, samples[0].prompt)
        text = fetch_metrics(server.url)
        record["cache_config"] = {k: cache_info(text).get(k) for k in ("block_size", "num_gpu_blocks")}
        before = parse_metrics(text, COUNTERS)
        stats_before = last_stats(server.log_text())
        t = time.monotonic()
        requests, series = run_load(server.url, [s.prompt for s in samples], args.max_tokens, args.poll)
        record["load_wall_s"] = time.monotonic() - t
        after = parse_metrics(fetch_metrics(server.url), COUNTERS)
        time.sleep(1.0)  # a stats line logged right after the last step
    finally:
        server.stop()
    stats = stats_delta(stats_before, last_stats(server.log_text()))
    record.update(summarize(requests, series, [s.key for s in samples], args.max_tokens))
    record["preemptions"] = after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)
    record["generation_tokens_metric"] = (after.get("vllm:generation_tokens_total", 0)
                                          - before.get("vllm:generation_tokens_total", 0))
    record["kvtrim_stats"] = stats
    record["eviction_share"] = eviction_share(stats)
    record["loadavg_after"] = list(os.getloadavg())
    record["per_request"] = [{k: v for k, v in r.items() if k != "text"}
                             | {"answer": r["text"][:80], "key": s.key, "depth": s.depth, "prompt_tokens": s.n_tokens}
                             for r, s in zip(requests, samples)]
    record["series"] = {"columns": ["t_s", "running", "waiting", "kv_usage"], "rows": series}
    return record


def write(out: pathlib.Path, data: dict) -> None:
    from report import table

    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out / "results.json")
    c, m = data["config"], data["machine"]
    lines = ["# Serving benchmark: plain vLLM vs `kvtrim serve`\n",
             f"{c['model']}, {c['requests']} concurrent requests of {c['prompt_tokens_measured']['mean']:.0f} prompt "
             f"tokens (passkey) + {c['max_tokens']} output tokens each, {c['blocks']} KV blocks, --max-num-seqs "
             f"{c['max_num_seqs']}, {_dtype(c)}; {m['cpu_count']} CPUs, torch {m['torch']}, vllm {m['vllm']}, kvtrim "
             f"{(m['kvtrim_commit'] or '?')[:10]}{' (dirty)' if m['kvtrim_dirty'] else ''}; {data['started']}; "
             f"1-minute load average {m['loadavg_start'][0]:.2f} at the start, "
             f"{m.get('loadavg_end', m['loadavg_start'])[0]:.2f} at the end.\n",
             f"    {data['command']}\n", *_commits_line(data["runs"]), table(data["runs"]), "",
             "× vLLM: ratio to plain vLLM (same load, same pool). Eviction share: compaction_s / step_s from the "
             "kvtrim worker's `kvtrim: stats` log line over the load (– where the server logs none). "
             "See benchmarks/serving/README.md for what each column means and what it cannot tell.", ""]
    (out / "results.md").write_text("\n".join(lines))


def plot(out: pathlib.Path) -> None:
    """serving.png with matplotlib from this interpreter, else from the repository's .venv."""
    import importlib.util

    script = HERE / "plot.py"
    python = sys.executable if importlib.util.find_spec("matplotlib") else ROOT / ".venv" / "bin" / "python"
    if not pathlib.Path(python).exists():
        print(f"plot skipped: no matplotlib here and no {python}; "
              f"run: .venv/bin/python {script} {out / 'results.json'}")
        return
    r = subprocess.run([str(python), str(script), str(out / "results.json")], capture_output=True, text=True)
    print(r.stdout.strip() or f"plot failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt  # unwinds through Server.stop()


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir
    from kvtrim.passkey import passkey_samples

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.model), local_files_only=True)
    samples = passkey_samples(tok, args.prompt_tokens, args.requests, seed=args.seed)
    config = config_of(args, samples)
    data = {"config": config, "machine": machine(), "command": " ".join([os.path.relpath(sys.executable, ROOT)
                                                                          if sys.executable.startswith(str(ROOT)) else
                                                                          sys.executable, *sys.argv]),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "runs": []}
    path = out / "results.json"
    if args.resume and path.exists():
        old = json.loads(path.read_text())
        if old.get("config") != config:
            was = old.get("config", {})
            diff = sorted(k for k in set(config) | set(was) if config.get(k) != was.get(k))
            raise SystemExit(f"run.py: error: --resume: {path} was made with other settings ({', '.join(diff)})")
        data["runs"] = [r for r in old["runs"] if "error" not in r]
    configs = ([] if args.no_plain else [(PLAIN, None)]) + [(m, m) for m in args.method_list]
    if args.plain_refused:
        print(f"note: {args.plain_refused}", flush=True)
    failed = 0
    for label, method in configs:
        if any(r["label"] == label for r in data["runs"]):
            print(f"[{label}] already in {path}: skipped (--resume)")
            continue
        t = time.monotonic()
        try:
            record = run_one(args, label, method, samples, out)
        except Exception as e:  # the server did not start or died: recorded, the others still run
            failed += not (method is None and args.plain_refused)  # a refusal announced by the note is the result
            record = {"label": label, "method": method, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
            print(f"[{label}] failed:\n{traceback.format_exc(limit=-3)}", flush=True)
        record["config_wall_s"] = time.monotonic() - t
        record["command"], record["started"] = data["command"], data["started"]
        record["kvtrim_commit"] = data["machine"]["kvtrim_commit"]  # rows kept by --resume keep their own
        data["runs"] = [r for r in data["runs"] if r["label"] != label] + [record]
        data["machine"]["loadavg_end"] = list(os.getloadavg())
        write(out, data)
        if "error" not in record:
            r = record
            print(f"[{label}] {_num(r['output_tok_s'])} out tok/s, running max {_num(r['running_max'])}, "
                  f"TTFT p50 {_num(r['ttft_median_s'])} s, passkey {r['passkey_found']}/{r['requests']}, "
                  f"{r['errors']} failed requests, {r['config_wall_s']:.0f} s", flush=True)
    order = {label: i for i, (label, _) in enumerate(configs)}
    data["runs"].sort(key=lambda r: order.get(r["label"], len(order)))
    write(out, data)
    plot(out)
    print((out / "results.md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the server is stopped, what finished is in results.json
        print("run.py: interrupted (finished configurations are in results.json; --resume runs the others)",
              file=sys.stderr)
        sys.exit(130)
