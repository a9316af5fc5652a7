"""`kvtrim eval --server URL` against a fake OpenAI-compatible server (http.server on 127.0.0.1, in a thread):
the requests it receives (prompt ids = the in-process path's, the method spec, greedy, max_tokens), rows scored
from canned completions, a 400 as an error row, and the one-line refusals before any request. No vLLM here."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import tiny_model
from kvtrim.cli import main
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.runner import RunSettings, Runner, check_run_settings, load_rows, plan, sample_budget
from kvtrim.eval.sample import write_task_file
from kvtrim.eval.server import spec_text
from kvtrim.eval.tasks import generate_samples
from kvtrim.methods import METHODS
from kvtrim.methods.base import KvtrimError
from kvtrim.models import resolve_model_dir
from kvtrim.specs import parse_method_spec, parse_method_specs

MODEL = "smollm2-135m"
EOS = 2  # SmolLM2's <|im_end|>: its generation config's and its tokenizer's EOS


class FakeServer:
    """An OpenAI-compatible server that records every request and answers completions with `respond(payload)`
    -> (status, body). Serves `model_id` (default: what `kvtrim serve --model smollm2-135m` reports)."""

    def __init__(self, respond=None, model_id: str | None = None, max_model_len: int = 8192, healthy: bool = True):
        self.requests: list[tuple[str, str, dict | None]] = []
        self.respond = respond or (lambda payload: (200, completion([EOS])))
        self.model_id = model_id or str(resolve_model_dir(MODEL))
        self.max_model_len = max_model_len
        self.healthy = healthy
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append(("GET", self.path, None))
                if self.path == "/v1/models":
                    self._answer(200, {"object": "list", "data": [
                        {"id": fake.model_id, "object": "model", "root": fake.model_id,
                         "max_model_len": fake.max_model_len}]})
                elif self.path == "/health":
                    self._answer(200 if fake.healthy else 503, {})
                else:
                    self._answer(404, {"error": {"message": "not found"}})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(("POST", self.path, payload))
                with fake.lock:
                    fake.in_flight += 1
                    fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
                try:
                    status, body = fake.respond(payload)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                self._answer(status, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def completions(self) -> list[dict]:
        return [p for method, path, p in self.requests if method == "POST" and path == "/v1/completions"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(token_ids: list[int], finish_reason: str = "stop") -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "(not read)", "token_ids": token_ids, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(token_ids), "total_tokens": 1}}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(MODEL))


@pytest.fixture(scope="module")
def samples(tok):
    fmt = PromptFormat(tok)
    return generate_samples("niah_single_1", fmt, 400, 1, seed=1) + generate_samples(
        "passkey", fmt, 300, 1, seed=1, depths=(0.5,))


@pytest.fixture
def task_file(samples, tmp_path):
    path = tmp_path / "tasks.jsonl"
    write_task_file(str(path), samples)
    return str(path)


@pytest.fixture
def fake():
    servers = []

    def start(**kwargs) -> FakeServer:
        servers.append(FakeServer(**kwargs))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _eval(task_file, out, url, *flags) -> int:
    return main(["eval", "--task-file", task_file, "--out", str(out), "--server", url, "--query-aware", "--no-plots",
                 "--quiet", *flags])


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtrim: error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_requests_hold_the_in_process_prompt_spec_and_greedy(fake, tok, samples, task_file, tmp_path):
    """Each job is one request: the prompt ids are those the in-process runner compresses with --query-aware,
    the spec parses into the very method it builds for that job, greedy, max_tokens = the task's cap."""
    server = fake()
    methods = "full,streaming,lazyeviction:window=4,keydiff"
    assert _eval(task_file, tmp_path / "out", server.url, "--methods", methods, "--compression-ratios", "0.5",
                 "--budgets", "64", "--max-new-tokens", "16") == 0
    sent = server.completions()
    jobs = plan(samples, parse_method_specs(methods.split(",")), [0.5], [64])
    assert len(sent) == len(jobs) == 2 * (1 + 3 * 2)
    settings = RunSettings(model=MODEL, query_aware=True, max_new_tokens=16)
    runner = Runner(tiny_model("llama", vocab=49152, layers=1), tok, settings, str(tmp_path / "unused"), progress=False)
    for job, payload in zip(jobs, sent):  # requests go out in plan order with one in flight
        compressed, after = runner.encode(job.sample)
        assert after.shape[-1] == 0 and payload["prompt"] == compressed[0].tolist()
        assert parse_method_spec(payload["vllm_xargs"]["kvtrim"]).build() == runner.build(job, compressed.shape[-1])
        assert payload["max_tokens"] == sample_budget(job.sample, 16)
        assert payload["temperature"] == 0 and payload["repetition_penalty"] == 1 and payload["top_k"] == 0
        assert payload["stop_token_ids"] == [EOS] and payload["return_token_ids"] is True
        assert payload["model"] == server.model_id
    by_key = {(p["vllm_xargs"]["kvtrim"]) for p in sent}
    n = len(runner.encode(samples[1])[0][0])
    assert {"full", "streaming:budget=64", f"streaming:budget={max(1, int(n * 0.5))}",
            "lazyeviction:budget=64:window=4", "keydiff:budget=64"} <= by_key
    rows = load_rows(str(tmp_path / "out"))
    assert [r["key"] for r in rows] == [j.key for j in jobs]
    assert all(r["backend"] == "vllm" and r["server_model"] == server.model_id and r["query_aware"] for r in rows)
    assert all(r["achieved_compression"] is None and r["peak_stored"] is None for r in rows)
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["backend"] == "vllm" and run["server_model"] == server.model_id and run["query_aware"]


def test_ratio_sizing_sends_compression_ratio(fake, task_file, tmp_path):
    server = fake()
    assert _eval(task_file, tmp_path / "out", server.url, "--methods", "streaming,lagkv:lag_size=64",
                 "--compression-ratios", "0.5", "--compression", "ratio", "--max-new-tokens", "4") == 0
    assert {p["vllm_xargs"]["kvtrim"] for p in server.completions()} == {
        "streaming:compression_ratio=0.5", "lagkv:compression_ratio=0.5:lag_size=64"}


def test_rows_are_scored_from_the_completion(fake, tok, samples, task_file, tmp_path):
    """The passkey sample is answered right (then rambles on): its row stops where the in-process path stops,
    once the answer holds the key; the niah sample is answered wrong (EOS dropped, every token kept)."""
    passkey = samples[1]
    key = passkey.answers[0]
    right = tok(f" The pass key is {key}. Remember it well.", add_special_tokens=False).input_ids
    wrong = tok(" I do not know.", add_special_tokens=False).input_ids

    def respond(payload):
        is_passkey = payload["prompt"] == PromptFormat(tok).encode(passkey)[0][0].tolist() + \
            PromptFormat(tok).encode(passkey)[1][0].tolist()
        return 200, completion((right if is_passkey else wrong) + [EOS])

    server = fake(respond=respond)
    assert _eval(task_file, tmp_path / "out", server.url, "--methods", "full", "--compression-ratios", "0.5") == 0
    rows = {r["task"]: r for r in load_rows(str(tmp_path / "out"))}
    hit, miss = rows["passkey"], rows["niah_single_1"]
    assert hit["score"] == 1 and hit["stopped_when_answered"] and key in hit["prediction"]
    assert "Remember" not in hit["prediction"] and hit["new_tokens"] < len(right)
    assert miss["score"] == 0 and miss["prediction"] == tok.decode(wrong) and miss["new_tokens"] == len(wrong)
    assert not miss["stopped_when_answered"] and miss["finish_reason"] == "stop"
    # --full-answers keeps the whole completion, as the in-process path decodes to the end
    assert _eval(task_file, tmp_path / "full", server.url, "--methods", "full", "--compression-ratios", "0.5",
                 "--full-answers") == 0
    whole = {r["task"]: r for r in load_rows(str(tmp_path / "full"))}["passkey"]
    assert whole["new_tokens"] == len(right) and "Remember it well." in whole["prediction"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "answered by a vLLM server" in summary and "| full | 0 | — |" in summary


def test_a_400_is_an_error_row_and_the_run_goes_on(fake, task_file, tmp_path, capsys):
    def respond(payload):
        if payload["vllm_xargs"]["kvtrim"].startswith("streaming"):
            return 400, {"error": {"message": "kvtrim: no streaming today\n(second line)", "type": "BadRequestError",
                                   "code": 400}}
        return 200, completion([EOS])

    server = fake(respond=respond)
    assert _eval(task_file, tmp_path / "out", server.url, "--methods", "full,streaming,keydiff",
                 "--budgets", "64") == 0
    rows = load_rows(str(tmp_path / "out"))
    assert len(rows) == len(server.completions()) == 6
    errors = [r for r in rows if "error" in r]
    assert [r["method"] for r in errors] == ["streaming", "streaming"]
    assert all(r["error"] == "HTTP 400: kvtrim: no streaming today (second line)" and "score" not in r for r in errors)
    assert all("score" in r for r in rows if r["method"] != "streaming")
    assert "server error: HTTP 400: kvtrim: no streaming today" in (tmp_path / "out" / "summary.md").read_text()


def test_a_500_is_a_row_while_the_server_is_healthy_and_stops_the_run_when_not(fake, task_file, tmp_path, capsys):
    respond = lambda payload: (500, {"error": {"message": "request needs 30 blocks, the pool has 12"}})  # noqa: E731
    server = fake(respond=respond)
    assert _eval(task_file, tmp_path / "ok", server.url, "--methods", "full", "--compression-ratios", "0.5") == 0
    assert all(r["error"].startswith("HTTP 500: request needs") for r in load_rows(str(tmp_path / "ok")))
    dead = fake(respond=respond, healthy=False)
    err = _error(capsys, ["eval", "--task-file", task_file, "--out", str(tmp_path / "dead"), "--server", dead.url,
                          "--query-aware", "--no-plots", "--quiet", "--methods", "full", "--compression-ratios", "0.5"])
    assert "fails /health" in err and load_rows(str(tmp_path / "dead")) == []


@pytest.mark.parametrize("flags, message", [
    (["--methods", "full,kvzip", "--compression-ratios", "0.5"], "KVzip is not supported inside vLLM"),
    (["--methods", "lagkv:compression_ratio=0.5:skip_layers=0", "--budgets", "64"], "skip_layers is not supported"),
    (["--methods", "adakv:method=keydiff", "--compression-ratios", "0.5"], "AdaKV keeps a different number"),
])
def test_a_method_the_engine_refuses_is_one_line_before_any_request(fake, task_file, tmp_path, capsys, flags, message):
    server = fake()
    err = _error(capsys, ["eval", "--task-file", task_file, "--out", str(tmp_path), "--server", server.url,
                          "--query-aware", "--no-plots", *flags])
    assert message in err and "nothing was sent" in err
    assert server.requests == []


def test_snapkv_runs_at_a_budget_and_a_ratio(fake, task_file, tmp_path):
    server = fake()
    assert _eval(task_file, tmp_path, server.url, "--methods", "snapkv", "--compression-ratios", "0.5",
                 "--budgets", "64", "--compression", "ratio") == 0
    assert {p["vllm_xargs"]["kvtrim"] for p in server.completions()} == {"snapkv:compression_ratio=0.5",
                                                                         "snapkv:budget=64"}


@pytest.mark.parametrize("flags, message", [
    ([], "needs --query-aware"),
    (["--query-aware", "--dtype", "bfloat16"], "--dtype does not apply with --server"),
    (["--query-aware", "--device", "cpu"], "--device does not apply with --server"),
    (["--query-aware", "--prefill-chunk-size", "64"], "--prefill-chunk-size does not apply"),
])
def test_settings_a_request_cannot_express_are_refused(fake, task_file, tmp_path, capsys, flags, message):
    server = fake()
    assert message in _error(capsys, ["eval", "--task-file", task_file, "--out", str(tmp_path), "--server", server.url,
                                      "--no-plots", *flags])
    assert server.requests == []


def test_no_server_is_one_line(task_file, tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = _error(capsys, ["eval", "--task-file", task_file, "--out", str(tmp_path), "--server",
                          f"http://127.0.0.1:{port}", "--query-aware", "--no-plots", "--methods", "full"])
    assert "no answer from the server" in err


def test_another_model_or_too_short_a_context_is_refused(fake, task_file, tmp_path, capsys):
    other = fake(model_id="/models/Qwen2.5-Coder-0.5B-Instruct")
    argv = ["--query-aware", "--no-plots", "--methods", "full", "--compression-ratios", "0.5"]
    err = _error(capsys, ["eval", "--task-file", task_file, "--out", str(tmp_path / "a"), "--server", other.url, *argv])
    assert "not --model smollm2-135m" in err and other.completions() == []
    renamed = fake(model_id="smollm2-135m")  # --served-model-name smollm2-135m: the same name
    assert main(["eval", "--task-file", task_file, "--out", str(tmp_path / "b"), "--server", renamed.url, "--quiet",
                 *argv]) == 0
    short = fake(max_model_len=256)
    err = _error(capsys, ["eval", "--task-file", task_file, "--out", str(tmp_path / "c"), "--server", short.url, *argv])
    assert "beyond the server's max_model_len of 256" in err and short.completions() == []


def test_requests_in_flight_and_rows_in_plan_order(fake, task_file, tmp_path, samples):
    """--batch-size 4: four requests at once; the first ones answer last, the rows are still in plan order."""
    order = []

    def respond(payload):
        with lock:
            order.append(payload["vllm_xargs"]["kvtrim"])
            first = len(order) <= 2
        time.sleep(0.6 if first else 0.05)
        return 200, completion([EOS])

    lock = threading.Lock()
    server = fake(respond=respond)
    methods = "full,streaming,keydiff,knorm"
    assert _eval(task_file, tmp_path, server.url, "--methods", methods, "--budgets", "64,32",
                 "--batch-size", "4") == 0
    jobs = plan(samples, parse_method_specs(methods.split(",")), [], [64, 32])
    assert [r["key"] for r in load_rows(str(tmp_path))] == [j.key for j in jobs]
    assert server.most_in_flight == 4


def test_resuming_into_another_backend_is_refused(fake, task_file, tmp_path, capsys):
    check_run_settings(str(tmp_path), RunSettings(model=MODEL, query_aware=True))  # an in-process run's folder
    server = fake()
    err = _error(capsys, ["eval", "--task-file", task_file, "--out", str(tmp_path), "--server", server.url,
                          "--query-aware", "--no-plots", "--methods", "full"])
    assert "backend='transformers'" in err and server.completions() == []


def test_an_older_run_file_reads_as_the_transformers_backend(tmp_path):
    settings = RunSettings(model=MODEL)
    check_run_settings(str(tmp_path), settings)
    path = tmp_path / "run.json"
    old = {k: v for k, v in json.loads(path.read_text()).items() if k not in ("backend", "server_model")}
    path.write_text(json.dumps(old))
    check_run_settings(str(tmp_path), settings)  # resumes
    with pytest.raises(KvtrimError, match="backend='transformers'"):
        check_run_settings(str(tmp_path), RunSettings(model=MODEL, backend="vllm", server_model="x"))


def test_reports_refuse_to_mix_backends():
    from kvtrim.eval.report import summarize

    row = {"method": "full", "method_name": "full", "compression_ratio": 0.0, "budget": None, "length": 10,
           "task": "t", "score": 1.0, "string_match_all": 1.0, "string_match_part": 1.0, "seconds": 1.0,
           "achieved_compression": 0.0, "final_compression": 0.0, "sample_id": "a"}
    served = dict(row, backend="vllm", server_model="m", achieved_compression=None, final_compression=None)
    assert summarize([served])[0]["achieved_compression"] is None
    with pytest.raises(KvtrimError, match="mix rows of transformers and vllm"):
        summarize([row, served])


@pytest.mark.parametrize("name", sorted(METHODS))
def test_spec_text_reads_back_as_the_same_method(name):
    """Every registered method, in the forms a sweep builds (at-budget, ratio, budget; a wrapper around a
    method), written as a spec and parsed back, is the same method."""
    spec = parse_method_spec("adakv:method=snapkv:window=16" if name == "adakv" else name)
    built = []
    for ratio, budget, sizing in ((0.5, None, "at-budget"), (0.5, None, "ratio"), (None, 96, "at-budget")):
        try:
            built.append(spec.build(700, ratio, sizing, budget=budget))
        except KvtrimError:
            continue
    assert built
    for method in built:
        assert parse_method_spec(spec_text(method)).build() == method, spec_text(method)
    assert spec_text(METHODS["full"]()) == "full"


def test_in_process_rows_say_their_backend(tok, samples, tmp_path):
    model = tiny_model("llama", vocab=49152, layers=1)
    torch.manual_seed(0)
    rows = Runner(model, tok, RunSettings(model=MODEL, max_new_tokens=2), str(tmp_path), progress=False).run(
        plan(samples[:1], parse_method_specs(["full"]), [0.5]))
    assert rows[0]["backend"] == "transformers" and "server_model" not in rows[0]
