"""`kvtrim bench`: speed and memory per method and context length (and `--vs-kvpress`)."""

from __future__ import annotations

import argparse
import gc
import pathlib
import shlex
import sys

from kvtrim.cli_args import lengths
from kvtrim.methods import METHODS
from kvtrim.methods.base import KvtrimError, check
from kvtrim.ray_cluster import add_ray_arguments, ray_options

DEFAULT_METHODS = ",".join(name for name, cls in METHODS.items() if not getattr(cls, "wraps", None))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", allow_abbrev=False, help="speed and memory per method and context length (vs the full cache, or vs kvpress)",
        description="Measure prefill time (and the part spent choosing what to evict), decode speed, stored "
                    "KV bytes and peak memory, per method and context length, interleaved; write JSON + plots.",
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name or local dir; 'arch:NAME' = that architecture with random weights")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated NAME[:param=value...] (default: every registered method at the "
                        "run's compression ratio); 'full' is always included")
    p.add_argument("--lengths", type=lengths, default=[1024, 2048, 4096, 8192],
                   help="prompt lengths in tokens, e.g. 1024,4k, at most the model's context (a length at the "
                        "context runs with room left for --max-new-tokens)")
    p.add_argument("--batch-sizes", type=lengths, default=[1], metavar="B,B,...",
                   help="sequences per cell, e.g. 1,4,8: distinct prompts of equal length in one cache (decode "
                        "throughput of the batch, vs the full cache at that batch and vs batch 1; allocated bytes)")
    p.add_argument("--compression-ratio", type=float, default=0.75,
                   help="fraction of the prompt's entries removed (methods built with at_budget)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens decoded after the prompt (all of them: "
                   "the benchmark does not stop at end-of-sequence)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench",
                   help="output folder (JSON + PNG); checked before any work, the JSON is rewritten after every cell")
    p.add_argument("--name", default="bench", help="file name prefix inside --out")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--trace-length", type=int, default=4096,
                   help="prompt length of the stored-bytes trace (0 = none)")
    p.add_argument("--trace-decode", type=int, default=256, help="decode steps in the stored-bytes trace")
    p.add_argument("--max-context", type=int, default=None,
                   help="raise the model's configured context (timing beyond it; outputs not meaningful)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new repeat (or trace) likely to end after this many seconds")
    p.add_argument("--no-same-size-decode", action="store_true",
                   help="skip the reference decode with a full cache of each method's stored size (the physical "
                        "limit the decode step is compared with)")
    p.add_argument("--no-path-memory", action="store_true",
                   help="skip the tensor-peak measurement of each user path (kvtrim.prefill, model.generate with and "
                        "without prompt_length=; once per method and length, untimed)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no progress lines")
    kv = p.add_argument_group("side by side with kvpress (--vs-kvpress)")
    kv.add_argument("--vs-kvpress", action="store_true",
                    help="compare with kvpress 0.5.5 (run scripts/kvpress_env.sh first) instead of the sweep")
    kv.add_argument("--kvpress-python", default=".venv-kvpress/bin/python")
    kv.add_argument("--passkey-trials", type=int, default=5)
    add_ray_arguments(p, "context lengths (one worker per node or per GPU)")
    p.set_defaults(func=cmd_bench)
    return p


def _command_line() -> str:
    return "kvtrim " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else ""


def _check_lengths(model: str, lengths: list[int], trace_length: int, max_context: int | None) -> None:
    """Every length within the model's context (or --max-context), known from the config alone."""
    from kvtrim.bench.arch import configured_context

    limit = configured_context(model)
    if not limit:
        return
    if max_context:
        check(max_context >= limit, f"--max-context {max_context} is below the model's context of {limit}")
        limit = max_context
    too_long = [n for n in lengths if n > limit]
    check(not too_long, f"--lengths {','.join(map(str, too_long))} beyond the model's context of {limit} tokens"
                        " (--max-context raises it, for timing only)")
    check(trace_length <= limit, f"--trace-length {trace_length} is beyond the model's context of {limit} tokens")


def _say(quiet: bool):
    return (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr, flush=True))


def cmd_bench(args) -> int:
    from kvtrim.bench.runner import BenchConfig, bench_methods
    from kvtrim.extras import require
    from kvtrim.models import check_device, parse_dtype
    from kvtrim.outdir import prepare_out_dir

    # validate everything before loading the model, the output folder last (it gets created)
    specs = bench_methods(args.methods)
    config = BenchConfig(
        model=args.model, methods=specs, lengths=args.lengths, compression_ratio=args.compression_ratio,
        new_tokens=args.max_new_tokens, repeats=args.repeats, device=args.device, dtype=args.dtype,
        warmup=not args.no_warmup, trace_length=args.trace_length, trace_decode=args.trace_decode, seed=args.seed,
        threads=args.threads, max_context=args.max_context, time_budget_s=args.time_budget,
        same_size_decode=not args.no_same_size_decode, batch_sizes=args.batch_sizes,
        path_memory=not args.no_path_memory,
    )
    config.validate()
    check(args.passkey_trials >= 1, f"--passkey-trials must be >= 1, got {args.passkey_trials}")
    check(bool(args.name) and "/" not in args.name and args.name not in (".", ".."),
          f"--name must be a plain file name prefix, got '{args.name}'")
    parse_dtype(args.dtype)
    check_device(args.device)
    ray = ray_options(args)
    if ray is not None:
        from kvtrim.bench.ray_bench import check_bench_options

        check(not args.vs_kvpress, "--ray runs the sweep, not --vs-kvpress")
        check_bench_options(ray)
        require("ray", "ray", "--ray")
    if args.vs_kvpress:
        check(not args.model.startswith("arch:"), "--vs-kvpress needs real weights (selections are compared)")
    elif not args.no_plots:
        require("matplotlib", "eval", "plotting the benchmark (or pass --no-plots)")
    if not args.model.startswith("arch:"):
        from kvtrim.models import load_tokenizer_and_config

        model_config = load_tokenizer_and_config(args.model)[1]  # not `config`: that is the BenchConfig
        for spec in specs:
            spec.check_config(model_config)
    _check_lengths(args.model, args.lengths, 0 if args.vs_kvpress else args.trace_length, args.max_context)
    out = pathlib.Path(prepare_out_dir(args.out))

    if args.vs_kvpress:
        from kvtrim.bench.kvpress_compare import CompareConfig, run_compare

        cfg = CompareConfig(model=args.model, lengths=args.lengths, compression_ratio=args.compression_ratio,
                            repeats=args.repeats, passkey_trials=args.passkey_trials, new_tokens=args.max_new_tokens,
                            kvpress_python=args.kvpress_python, threads=args.threads, seed=args.seed,
                            peaks=not args.no_path_memory)
        run_compare(cfg, out, command=_command_line(), progress=_say(args.quiet))
        return 0

    from kvtrim.bench.arch import load_bench_model
    from kvtrim.bench.runner import run_bench
    from kvtrim.bench.summary import write_json

    path = out / f"{args.name}.json"

    def checkpoint(partial: dict) -> None:
        partial["meta"]["command"] = _command_line()
        write_json(partial, path)

    if ray is not None:  # the workers load the model; the driver merges their lengths
        from kvtrim.bench.ray_bench import BenchLoader, run_bench_ray

        loader = BenchLoader(args.model, args.dtype, args.device, args.max_context, args.seed)
        result = run_bench_ray(loader, config, ray, plugins=args.plugin, checkpoint=checkpoint)
        return _finish(result, path, out, args)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    model, tok, info = load_bench_model(args.model, args.dtype, args.device, args.max_context, args.seed)
    gc.collect()
    gc.freeze()  # the model's objects are permanent: later collections (one per measured block) stay cheap
    try:
        result = run_bench(model, tok, config, progress=_say(args.quiet), model_info=info, bar=not args.quiet,
                           checkpoint=checkpoint)
    finally:
        gc.unfreeze()
    return _finish(result, path, out, args)


def _finish(result: dict, path: pathlib.Path, out: pathlib.Path, args) -> int:
    """Write the final JSON and the plots."""
    from kvtrim.bench.summary import write_json

    result["meta"]["command"] = _command_line()
    write_json(result, path)
    print(path)
    if not args.no_plots:
        from kvtrim.bench.plots import plot_all

        for p in plot_all(result, out, prefix=args.name):
            print(p)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("use: kvtrim bench ...")


__all__ = ["add_parser", "cmd_bench", "KvtrimError"]
