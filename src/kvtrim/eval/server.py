"""`kvtrim eval --server URL`: the sweep's jobs as requests to a running `kvtrim serve` (vLLM's OpenAI server).

Each job (sample x method x setting) is one `POST /v1/completions`:

* `prompt`: token ids, built as the in-process path builds them (`PromptFormat`: the same tokenizer, chat
  template or `--raw`), in the query-aware layout (context and question in one prompt: the engine
  compresses the whole prompt, so the query-agnostic protocol, compress the context and then feed the
  question, cannot be expressed; `--server` needs `--query-aware`);
* `vllm_xargs: {"kvtrim": SPEC}`: the method the in-process path builds for that job (`MethodSpec.build`
  at that prompt's length and setting), written back as a spec (`spec_text`) and checked to parse into the
  very same method; every spec is checked against the engine's rules (`kvtrim.vllm.spec.method_for_vllm`,
  no vLLM import) before any request;
* greedy: `temperature` 0 and every other sampling parameter neutral (a server otherwise applies the
  model's `generation_config.json` defaults, e.g. a repetition penalty); `max_tokens`: the task's cap;
  `stop_token_ids`: the in-process path's stop tokens (`kvtrim.decoding.eos_ids`); `return_token_ids`.

The answer is the completion's token ids (a stop token at its end dropped, as `greedy_decode` never returns
it), cut where the in-process path would have stopped (the first prefix that holds every reference, unless
`--full-answers`): greedy decoding gives that prefix either way, so the row's prediction is the in-process
one whenever the engine's tokens are. It is scored by the task's metric and written to the same
`results.jsonl`, with `backend: "vllm"`, the server's model id and the spec sent. What the server cannot say
(achieved and final compression, entries stored while decoding, KV bytes) is null. A request the server
refuses (HTTP 4xx) or fails (HTTP 500: a request its method can never fit, a method that broke the engine's
contract) becomes a row holding the error line, not scored; no other row is lost. A server that cannot be
reached stops the run in one line (the rows written so far stay; the run resumes).

`--batch-size N` is the number of requests in flight; rows are written in plan order whatever the order
they finish in. No vLLM import here: the client runs in kvtrim's own environment.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import MISSING, dataclass, fields

from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.runner import (RESULTS, Job, RunSettings, answer_fields, answered_rule, check_run_settings, job_row,
                                load_rows, sample_budget, write_row)
from kvtrim.methods.base import EvictionMethod, KvtrimError, check

BACKEND = "vllm"
#: seconds one request may take (a long generation on a CPU, behind the requests in flight before it)
REQUEST_TIMEOUT_S = 3600
#: seconds the start-up call (`/v1/models`) may take
CONNECT_TIMEOUT_S = 30
#: sampling parameters that make vLLM's sampler an argmax whatever the model's generation_config.json says
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
          "presence_penalty": 0.0, "frequency_penalty": 0.0}


# ---- method specs --------------------------------------------------------------------------------------
def _value_text(value, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        check(all(isinstance(v, int) and not isinstance(v, bool) for v in value),
              f"{where}: {value!r} cannot be written in a method spec")
        return "+".join(str(v) for v in value)
    if isinstance(value, (int, float)):
        return repr(value)  # a float's repr reads back to the same float
    if isinstance(value, str) and not any(c in value for c in ":,=") and value.strip() == value and value:
        return value
    raise KvtrimError(f"{where}: {value!r} cannot be written in a method spec")


def _changed_params(method: EvictionMethod) -> list[tuple[str, object]]:
    """`method`'s parameters that differ from their defaults, in declaration order."""
    out = []
    for f in fields(method):
        if not f.init:
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        value = getattr(method, f.name)
        if default is MISSING or value != default:
            out.append((f.name, value))
    return out


def spec_text(method: EvictionMethod) -> str:
    """`method` as a spec (`NAME:param=value...`, its parameters that differ from their defaults) that parses
    into an equal method; a one-line `KvtrimError` when it cannot be written as one."""
    from kvtrim.specs import parse_method_spec

    name = type(method).name
    wraps = getattr(type(method), "wraps", None)
    parts = [name]
    for key, value in _changed_params(method):
        if wraps and key == wraps:  # a wrapper: the wrapped method's name, then its parameters
            parts.append(f"{key}={type(value).name}")
            parts += [f"{k}={_value_text(v, name)}" for k, v in _changed_params(value)]
        else:
            parts.append(f"{key}={_value_text(value, name)}")
    text = ":".join(parts)
    try:
        same = parse_method_spec(text).build() == method
    except KvtrimError:
        same = False
    check(same, f"{method.describe()} cannot be written as a method spec for the server (got '{text}')")
    return text


# ---- the server ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServedModel:
    """What `GET /v1/models` says of the (first) model a server serves."""

    id: str
    root: str | None = None
    max_model_len: int | None = None


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


class RequestFailed(Exception):
    """The server answered a request with an error status: the row records `line`."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def _error_line(err: urllib.error.HTTPError) -> str:
    """`HTTP <code>: <the server's message>` in one line (vLLM's error body: {"error": {"message": ...}})."""
    try:
        body = err.read().decode("utf-8", "replace")
    except OSError:
        body = ""
    message = body
    try:
        data = json.loads(body)
        inner = data.get("error", data) if isinstance(data, dict) else data
        message = inner.get("message", body) if isinstance(inner, dict) else inner or body
    except (ValueError, AttributeError):
        pass
    return _one_line(f"HTTP {err.code}: {message or err.reason}")


def _call(url: str, path: str, payload: dict | None, timeout: float) -> dict:
    """GET (payload None) or POST JSON to `url + path`; the decoded JSON answer. An error status raises
    `RequestFailed`; no answer at all (refused, reset, timed out) a one-line `KvtrimError`."""
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read().decode("utf-8"))
    except urllib.error.HTTPError as err:
        if 400 <= err.code <= 500:  # this request's own error (a refused spec; 500: kvtrim serve's per-request end)
            raise RequestFailed(_error_line(err)) from None
        raise KvtrimError(f"the server at {url} answered {path} with {_error_line(err)}") from None
    except (urllib.error.URLError, OSError) as err:  # URLError wraps refused connections; timeouts are OSError
        reason = getattr(err, "reason", err)
        raise KvtrimError(f"no answer from the server at {url} ({path}): {_one_line(reason)}") from None
    except ValueError as err:
        raise KvtrimError(f"the server at {url} ({path}) did not answer JSON: {_one_line(err)}") from None


def check_url(url: str) -> str:
    check(url.startswith(("http://", "https://")), f"--server must be a URL such as http://127.0.0.1:8000, got '{url}'")
    return url.rstrip("/").removesuffix("/v1")


def connect(url: str) -> ServedModel:
    """The model the server at `url` serves (`GET /v1/models`, once, at start); one line if it cannot say."""
    try:
        answer = _call(url, "/v1/models", None, CONNECT_TIMEOUT_S)
    except RequestFailed as err:
        raise KvtrimError(f"the server at {url} refused GET /v1/models: {err.line}") from None
    models = answer.get("data") if isinstance(answer, dict) else None
    check(bool(models) and isinstance(models[0], dict) and "id" in models[0],
          f"the server at {url} lists no model at /v1/models (is it vLLM's OpenAI server?)")
    check(len(models) == 1, f"the server at {url} serves {len(models)} models; kvtrim eval --server needs one")
    card = models[0]
    return ServedModel(str(card["id"]), card.get("root"), card.get("max_model_len"))


def check_model(served: ServedModel, model: str) -> None:
    """Refuse, in one line, a server whose model is clearly not `--model` (which builds the prompts): the
    served model's id or path must be `--model`, the directory it resolves to (the same directory, or one
    with the same config.json), or have the same last path component."""
    from kvtrim.models import resolve_model_dir

    local = resolve_model_dir(model)
    wanted = {model, str(local)}
    names = [n for n in (served.id, served.root) if n]
    if any(n in wanted for n in names):
        return
    local_dir = os.path.isdir(local)
    for name in names:
        if local_dir and os.path.isdir(name):
            if os.path.realpath(name) == os.path.realpath(local) or _same_config(name, str(local)):
                return
            continue
        last = lambda s: os.path.basename(str(s).rstrip("/")).lower()  # noqa: E731
        if last(name) in {last(model), last(local)}:
            return
    raise KvtrimError(f"the server serves '{served.root or served.id}', not --model {model} ({local}): the prompts "
                      "are built with --model's tokenizer; give --model the served model")


def _same_config(a: str, b: str) -> bool:
    def read(d):
        try:
            with open(os.path.join(d, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
        ignore = {"_name_or_path", "transformers_version", "torch_dtype", "dtype"}
        return {k: v for k, v in config.items() if k not in ignore}

    first = read(a)
    return first is not None and first == read(b)


def stop_token_ids(model: str, tokenizer) -> list[int]:
    """The tokens the in-process path stops at (`kvtrim.decoding.eos_ids`: the generation config's EOS and the
    tokenizer's), read without the weights."""
    from transformers import GenerationConfig

    from kvtrim.models import resolve_model_dir

    try:
        ids = GenerationConfig.from_pretrained(resolve_model_dir(model), local_files_only=True).eos_token_id
    except (OSError, ValueError):
        ids = None
    out = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        out.add(tokenizer.eos_token_id)
    return sorted(out)


# ---- the sweep --------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """One job ready to send: its row's first fields and its request, or the reason it cannot run (`skipped`:
    the method cannot be configured at that setting, as the in-process path records it)."""

    job: Job
    row: dict
    payload: dict | None = None
    skipped: str | None = None


@dataclass
class ServerRunner:
    """The sweep through a server: `prepare` (every job's request, the engine's refusals checked, before any
    request), then `run` (pending jobs, `settings.batch_size` requests in flight, rows in plan order)."""

    url: str
    served: ServedModel | None  # set once connected (`connect`); `prepare` needs no server
    tokenizer: object
    settings: RunSettings
    out_dir: str
    stop_ids: list[int]
    progress: bool = True
    rows_written: int = 0

    def __post_init__(self):
        self.fmt = PromptFormat(self.tokenizer, chat=self.settings.chat)
        self._prepared: dict[str, Prepared] = {}

    def prompt_ids(self, sample) -> list[int]:
        """The prompt as token ids: the in-process path's compressed part in the query-aware layout."""
        prefix, suffix = self.fmt.encode(sample)
        return prefix[0].tolist() + suffix[0].tolist()

    def prepare(self, jobs: list[Job]) -> None:
        """Build every job's method and request (no server needed); refuse, in one line, what the engine would
        refuse (every distinct spec through `method_for_vllm`), before any request."""
        from kvtrim.vllm.spec import method_for_vllm

        ids: dict[str, list[int]] = {}
        refused: dict[str, str] = {}
        for job in jobs:
            sample = job.sample
            if sample.id not in ids:
                ids[sample.id] = self.prompt_ids(sample)
            prompt = ids[sample.id]
            n, budget = len(prompt), sample_budget(sample, self.settings.max_new_tokens)
            row = job_row(job, n, 0, query_aware=True, backend=BACKEND)
            try:
                method = job.spec.build(n, job.compression_ratio, self.settings.compression, budget=job.budget)
            except KvtrimError as err:
                row.update(skipped=str(err))
                self._prepared[job.key] = Prepared(job, row, skipped=str(err))
                continue
            text = spec_text(method)
            try:
                method_for_vllm(text)
            except KvtrimError as err:
                refused.setdefault(text, str(err))
            row["method_config"] = method.describe()
            row["vllm_spec"] = text
            payload = {"prompt": prompt, "max_tokens": budget, **GREEDY,
                       "stop_token_ids": self.stop_ids, "return_token_ids": True, "vllm_xargs": {"kvtrim": text}}
            self._prepared[job.key] = Prepared(job, row, payload)
        if refused:
            first = next(iter(refused.values()))
            more = f" (and {len(refused) - 1} more spec(s))" if len(refused) > 1 else ""
            raise KvtrimError(f"the vLLM engine refuses {first}{more}; nothing was sent")

    def check_fits(self, jobs: list[Job]) -> None:
        """Refuse, in one line, a sample whose prompt and answer do not fit the served model's length."""
        limit = self.served.max_model_len
        for job in jobs:
            p = self._prepared[job.key]
            need = p.row["prompt_tokens"] + sample_budget(job.sample, self.settings.max_new_tokens)
            check(not limit or need <= limit, f"sample {job.sample.id} needs {need} tokens (prompt + max_new_tokens), "
                                              f"beyond the server's max_model_len of {limit}")

    def _send(self, payload: dict) -> tuple[dict | RequestFailed, float]:
        start = time.perf_counter()
        try:
            answer = _call(self.url, "/v1/completions", {"model": self.served.id, **payload}, REQUEST_TIMEOUT_S)
        except RequestFailed as err:
            if err.line.startswith("HTTP 500"):  # this request's end, or a dead engine: only the first is a row
                self.check_health()
            return err, time.perf_counter() - start
        return answer, time.perf_counter() - start

    def check_health(self) -> None:
        """Stop the run (one line) when the server no longer answers `/health` (a dead engine answers every
        request with HTTP 500: those are not rows to keep)."""
        request = urllib.request.Request(self.url + "/health")
        try:
            with urllib.request.urlopen(request, timeout=CONNECT_TIMEOUT_S) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        raise KvtrimError(f"the server at {self.url} answered HTTP 500 and fails /health: stopped (the rows "
                          "written so far stay; run the same command again to resume)")

    def _finish(self, p: Prepared, answer: dict | RequestFailed, seconds: float) -> dict:
        row = {**p.row, "server_model": self.served.id}
        if isinstance(answer, RequestFailed):
            row.update(error=answer.line, seconds=round(seconds, 3))
            return row
        try:
            choice = answer["choices"][0]
            tokens = list(choice["token_ids"])
        except (KeyError, IndexError, TypeError):
            row.update(error="the server's answer holds no token_ids (is it vLLM's OpenAI server?)",
                       seconds=round(seconds, 3))
            return row
        if tokens and tokens[-1] in self.stop_ids:  # the stop token: greedy_decode does not return it
            tokens.pop()
        sample = p.job.sample
        budget = p.payload["max_tokens"]
        done = answered_rule(sample, self.tokenizer, self.settings.stop_when_answered)
        if done is not None:  # where greedy_decode would have stopped: the first prefix that answers
            tokens = next((tokens[:k] for k in range(1, len(tokens) + 1) if done(tokens[:k])), tokens)
        row.update(
            **answer_fields(self.tokenizer, sample, tokens, budget, done),
            # the server does not report its cache: left empty, not estimated
            achieved_compression=None, final_compression=None, peak_stored=None, final_stored=None,
            stored_trace=None, kv_bytes=None, kv_bytes_full=None, stored_per_layer_mean=None,
            prefill_reused=False, finish_reason=choice.get("finish_reason"),
            seconds=round(seconds, 3),  # the request's latency (requests overlap with --batch-size > 1)
        )
        return row

    def run(self, jobs: list[Job]) -> list[dict]:
        """Send the jobs not yet in `results.jsonl` (`prepare` first); returns all rows of the file afterwards."""
        from tqdm.auto import tqdm

        check_run_settings(self.out_dir, self.settings)
        missing = [job.key for job in jobs if job.key not in self._prepared]
        check(not missing, "ServerRunner.run: prepare the jobs first")
        done_keys = {row.get("key") for row in load_rows(self.out_dir, repair=True)}
        pending = [self._prepared[job.key] for job in jobs if job.key not in done_keys]
        bar = tqdm(total=len(jobs), initial=len(jobs) - len(pending), desc="kvtrim eval (server)", unit="run",
                   disable=not self.progress, dynamic_ncols=True)
        pool = ThreadPoolExecutor(max_workers=max(1, self.settings.batch_size), thread_name_prefix="kvtrim-eval")
        futures: list[Future | None] = [pool.submit(self._send, p.payload) if p.payload is not None else None
                                        for p in pending]
        try:
            with open(os.path.join(self.out_dir, RESULTS), "a", encoding="utf-8") as out:
                for p, future in zip(pending, futures):  # plan order, whatever order they finish in
                    row = ({**p.row, "server_model": self.served.id} if future is None
                           else self._finish(p, *future.result()))
                    write_row(out, row)
                    self.rows_written += 1
                    bar.update(1)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # an interrupted run leaves only the requests in flight
            bar.close()
        return load_rows(self.out_dir)

    def line(self, jobs: list[Job]) -> str:
        """What is about to run, printed before it does."""
        done_keys = {row.get("key") for row in load_rows(self.out_dir)}
        pending = sum(job.key not in done_keys for job in jobs)
        return (f"server {self.url}: model {self.served.id}; {pending} of {len(jobs)} runs pending, "
                f"{max(1, self.settings.batch_size)} request(s) in flight")
