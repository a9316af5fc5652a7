"""Bad command-line input: exit code 2, exactly one stderr line `kvtrim: error: ...`, no traceback, and
for input that can be checked before the weights load, no weights loaded.

The weight loaders (`kvtrim.models.load_model`, `kvtrim.bench.arch.load_bench_model` and transformers'
`AutoModelForCausalLM.from_pretrained`) are replaced by functions that fail the test when called.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import kvtrim.bench.arch
import kvtrim.models
from kvtrim.cli import main


class WeightsLoaded(AssertionError):
    """Not a KvtrimError: if a command loads weights, this escapes `main` and fails the test."""


@pytest.fixture
def no_weights(monkeypatch):
    def fail(*args, **kwargs):
        raise WeightsLoaded("weights were loaded for input that could be checked before")

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(kvtrim.models, "load_model", fail)
    monkeypatch.setattr(kvtrim.bench.arch, "load_bench_model", fail)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fail)


@pytest.fixture
def no_tokenizer(monkeypatch):
    """For input checkable before even the tokenizer and config load."""

    def fail(*args, **kwargs):
        raise WeightsLoaded("the tokenizer/config was loaded for input that could be checked before")

    monkeypatch.setattr(kvtrim.models, "load_tokenizer_and_config", fail)


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvtrim: error: ") and "Traceback" not in captured.err
    return lines[0]


@pytest.fixture
def files(tmp_path):
    made = {
        "binary": b"\x7fELF\x02\x01\x01\x00\xff\xfe\x80 not text",
        "nul": b"\x00" * 64,
        "empty": b"",
    }
    paths = {}
    for name, data in made.items():
        paths[name] = tmp_path / name
        paths[name].write_bytes(data)
    paths["a_file"] = tmp_path / "a_file"
    paths["a_file"].write_text("I am a file")
    return paths


# ---- kvtrim generate -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--prompt-file", "{binary}"], "is not UTF-8 text"),
        (["--prompt-file", "{nul}"], "is not text (it contains NUL bytes)"),
        (["--raw", "--prompt", ""], "the prompt (--prompt) is empty"),
        (["--prompt", ""], "the prompt (--prompt) is empty"),
        (["--prompt", " \n\t"], "is empty"),
        (["--raw", "--prompt-file", "{empty}"], "is empty"),
        (["--prompt", "hi", "--device", "tpu9"], "invalid device 'tpu9'"),
        (["--prompt", "hi", "--device", "cuda:99"], "device 'cuda:99' is not available"),
        (["--prompt", "hi", "--device", "xla"], "device type 'xla' is not supported"),
        (["--prompt", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
        (["--prompt", "hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
        (["--prompt", "hi", "--temperature", "inf"], "--temperature must be a finite number >= 0"),
        (["--prompt", "hi", "--max-new", "3"], "unrecognized arguments: --max-new 3"),  # no abbreviations
        (["--prompt", "hi", "--max-new-tokens", "x"], "invalid int value"),
    ],
)
def test_generate_bad_input_before_loading(argv, fragment, files, capsys, no_weights, no_tokenizer):
    argv = [a.format(**files) for a in argv]
    assert fragment in one_line_error(capsys, ["generate", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch build has CUDA")
def test_cuda_on_a_cpu_only_torch(capsys, no_weights, no_tokenizer):
    assert "no CUDA support" in one_line_error(capsys, ["generate", "--prompt", "hi", "--device", "cuda"])


@pytest.mark.parametrize("data", [b"", b"\xff\xfe\xfd"])
def test_empty_or_binary_stdin(data, monkeypatch, capsys, no_weights, no_tokenizer):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    err = one_line_error(capsys, ["generate", "--raw"])
    assert ("stdin) is empty" if not data else "stdin is not UTF-8 text") in err


def test_unknown_hub_id_fails_at_once_saying_offline(capsys, no_weights):
    err = one_line_error(capsys, ["generate", "--prompt", "hi", "--model", "nobody-knows/no-such-model-here"])
    assert "not in the local Hugging Face cache" in err and "never downloads" in err


def test_local_folder_without_a_model(tmp_path, capsys, no_weights):
    assert "is not a model directory" in one_line_error(capsys, ["generate", "--prompt", "hi", "--model",
                                                                 str(tmp_path)])


def test_missing_models_extra_is_named(monkeypatch, tmp_path, capsys, no_weights):
    """Converting a named GGUF model without gguf installed: one line naming kvtrim[models]."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    monkeypatch.setenv("KVTRIM_CACHE", str(tmp_path))  # no converted copy: the GGUF would be read
    err = one_line_error(capsys, ["generate", "--prompt", "hi"])
    assert "needs gguf" in err and "pip install 'kvtrim[models]'" in err


# ---- kvtrim eval ---------------------------------------------------------------------------------------
def _task_file(tmp_path, **changes) -> str:
    row = {"context": "The sky is blue.", "question": "What colour is the sky?", "answers": ["blue"],
           "max_new_tokens": 8, **changes}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return str(path)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--out", "/proc/kvtrim-cannot-write-here"], "is not a writable folder"),
        (["--out", "{a_file}"], "names an existing file, not a folder"),
        (["--device", "tpu9"], "invalid device 'tpu9'"),
        (["--write-tasks", "/proc/kvtrim-nowhere/t.jsonl"], "--write-tasks"),
        (["--task-file", "{binary}"], "cannot read task file"),
        (["--compression-ratios", "0.5", "--out", "/proc/x", "--preset", "quick"], "is not a writable folder"),
        (["--sample", "1"], "unrecognized arguments: --sample 1"),  # no abbreviations
    ],
)
def test_eval_bad_input_before_loading(argv, fragment, files, capsys, no_weights, no_tokenizer, tmp_path):
    argv = [a.format(**files) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    assert fragment in one_line_error(capsys, ["eval", "--no-plots", *argv])


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"length": "abc"}, "'length' must be a non-negative integer"),
        ({"meta": [1, 2, 3]}, "'meta' must be a JSON object"),
        ({"max_new_tokens": True}, "'max_new_tokens' must be a positive integer, got True"),
        ({"max_new_tokens": 2.5}, "'max_new_tokens' must be a positive integer"),
        ({"depth": True}, "'depth' must be a number in [0, 1]"),
        ({"task": ["a"]}, "'task' must be a string"),
    ],
)
def test_task_file_wrong_types(changes, fragment, tmp_path, capsys, no_weights, no_tokenizer):
    argv = ["eval", "--no-plots", "--task-file", _task_file(tmp_path, **changes), "--out", str(tmp_path / "o")]
    assert fragment in one_line_error(capsys, argv)


def test_task_file_beyond_the_context_fails_before_the_weights(tmp_path, capsys, no_weights):
    """Known only from the tokenizer and config (loaded), still before any weights."""
    argv = ["eval", "--no-plots", "--task-file", _task_file(tmp_path, max_new_tokens=100000),
            "--out", str(tmp_path / "o")]
    assert "beyond the model's context of 8192" in one_line_error(capsys, argv)


def test_resuming_with_other_settings_fails_before_the_weights(tmp_path, capsys, no_weights):
    (tmp_path / "run.json").write_text(json.dumps({"model": "smollm2-135m", "dtype": "bfloat16"}))
    argv = ["eval", "--no-plots", "--tasks", "passkey", "--lengths", "400", "--samples", "1", "--depths", "0.5",
            "--methods", "full", "--out", str(tmp_path)]
    assert "holds results made with other settings" in one_line_error(capsys, argv)


def test_eval_out_is_checked_before_the_tokenizer(capsys, no_weights, no_tokenizer, tmp_path):
    """Everything else is valid: the only thing wrong is --out, and nothing was loaded to find that out."""
    err = one_line_error(capsys, ["eval", "--tasks", "passkey", "--lengths", "512", "--out", "/proc/x/y"])
    assert "--out /proc/x/y" in err


def test_missing_eval_extra_is_named(monkeypatch, tmp_path, capsys, no_weights, no_tokenizer):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    err = one_line_error(capsys, ["eval", "--report-only", "--out", str(tmp_path)])
    assert "needs matplotlib" in err and "'kvtrim[eval]'" in err and "--no-plots" in err
    err = one_line_error(capsys, ["bench", "--model", "arch:tiny-llama", "--lengths", "64", "--out", str(tmp_path)])
    assert "'kvtrim[eval]'" in err


# ---- kvtrim bench --------------------------------------------------------------------------------------
BENCH = ["bench", "--model", "arch:tiny-llama", "--methods", "streaming", "--lengths", "64", "--no-plots"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--out", "/proc/kvtrim-cannot-write-here"], "is not a writable folder"),
        (["--out", "{a_file}"], "names an existing file, not a folder"),
        (["--lengths", "100000"], "--lengths 100000 beyond the model's context of 4096 tokens"),
        (["--lengths", "64,5000"], "--lengths 5000 beyond"),
        (["--lengths", "64", "--max-context", "1024"], "--max-context 1024 is below the model's context"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--time-budget", "-1"], "--time-budget must be a positive number of seconds"),
        (["--time-budget", "nan"], "--time-budget must be a positive number of seconds"),
        (["--device", "tpu9"], "invalid device 'tpu9'"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
        (["--name", "a/b"], "--name must be a plain file name prefix"),
        (["--model", "arch:nope"], "unknown architecture 'nope'"),
        (["--repeat", "2"], "unrecognized arguments: --repeat 2"),  # no abbreviations
    ],
)
def test_bench_bad_input_before_loading(argv, fragment, files, capsys, no_weights, no_tokenizer, tmp_path):
    argv = [a.format(**files) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    assert fragment in one_line_error(capsys, [*BENCH, *argv])
    assert not (tmp_path / "out").exists()  # the output folder is made last, after every other check


def test_bench_lengths_of_a_named_model_are_checked_from_its_config(capsys, no_weights, tmp_path):
    err = one_line_error(capsys, ["bench", "--lengths", "100000", "--out", str(tmp_path)])
    assert "--lengths 100000 beyond the model's context of 8192 tokens" in err


def test_bench_keeps_what_it_measured_when_interrupted(monkeypatch, tmp_path, capsys):
    """Results are written as they complete: an interruption after two cells leaves both in the JSON."""
    import kvtrim.bench.runner as runner

    calls = []
    original = runner.measure_cell

    def measure(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "measure_cell", measure)
    threads = torch.get_num_threads()
    try:
        rc = main([*BENCH, "--threads", "1", "--no-warmup", "--repeats", "2", "--max-new-tokens", "2",
                   "--trace-length", "0", "--out", str(tmp_path), "--quiet"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 130
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["complete"] is False and len(result["raw"]) == 2
    assert all(r["status"] == "ok" for r in result["raw"])
    assert capsys.readouterr().err.strip() == "kvtrim: interrupted"  # --quiet: no bar, no progress lines


def test_bench_progress_bar(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        assert main([*BENCH, "--threads", "1", "--repeats", "1", "--max-new-tokens", "2", "--trace-length", "0",
                     "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "kvtrim bench" in err and "cell" in err and "100%" in err
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["complete"] is True


# ---- listings, environment, console entry point ----------------------------------------------------------
def test_json_listings(capsys):
    assert main(["methods", "--json"]) == 0
    methods = json.loads(capsys.readouterr().out)
    lagkv = next(m for m in methods if m["name"] == "lagkv")
    assert any(p["flag"] == "--lag-size" and p["type"] == "int" for p in lagkv["params"])
    assert main(["models", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in models if m["default"]] == ["smollm2-135m"]
    assert main(["models"]) == 0
    assert capsys.readouterr().out.count("(default)") == 1


def test_cache_stats_print_readably():
    from kvtrim.cache import CacheStats

    stats = CacheStats(tokens_seen=100, stored_per_layer=[25, 25], peak_per_layer=[100, 100], bytes_stored=1 << 20,
                       bytes_full=4 << 20, bytes_bookkeeping=2048)
    text = str(stats)
    assert "compression ratio 0.750" in text and "tokens seen 100" in text and "\n" not in text


def test_import_does_not_touch_the_environment():
    code = ("import os, transformers.masking_utils, transformers.cache_utils; before = dict(os.environ); "
            "import kvtrim, kvtrim.models, kvtrim.cli; print(dict(os.environ) == before)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("argv", [["generate", "--prompt-file", "{binary}"], ["bench", "--threads", "0"],
                                  ["eval", "--out", "/proc/x"]])
def test_console_entry_point_prints_one_line(argv, files):
    argv = [a.format(**files) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "kvtrim.cli", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("kvtrim: error: ")
