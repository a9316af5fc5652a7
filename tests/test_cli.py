"""The command line: listings, one-line errors, and a real generation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtrim.cli import main


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--method", "lagkv", "--keep-ratio", "1.5"], "keep_ratio must be in (0, 1]"),
        (["--method", "lagkv", "--keep-ratio", "0"], "keep_ratio must be in (0, 1]"),
        (["--method", "lagkv", "--lag-size", "0"], "lag_size must be >= 1"),
        (["--method", "lagkv", "--sink-size", "-3"], "sink_size must be >= 0"),
        (["--method", "lagkv", "--window", "10"], "method 'lagkv' has no parameter window"),
        (["--method", "lagkv:lag_size=64", "--lag-size", "32"], "parameter lag_size given twice"),
        (["--method", "lagkv:lag_size=x"], "cannot read 'x' as int"),
        (["--method", "nope"], "unknown method 'nope'"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt-file", "/does/not/exist"], "cannot read prompt file"),
        (["--model", "no-such-model"], "unknown model 'no-such-model'; known models: smollm2-135m"),
    ],
)
def test_bad_input_fails_with_one_line(argv, fragment, capsys):
    assert main(["generate", "--prompt", "hi", *argv] if "--prompt-file" not in argv else ["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtrim: error: ") and fragment in err and "\n" not in err


def test_error_has_no_traceback_from_the_console_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "kvtrim.cli", "generate", "--method", "lagkv", "--keep-ratio", "2", "--prompt", "x"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "kvtrim: error: keep_ratio must be in (0, 1], got 2.0"


def test_methods_and_models_listings(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for line in ("lagkv", "keep_ratio", "lag_size", "streaming", "budget", "full", "knorm", "spec syntax"):
        assert line in out
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "(default)" in out and "--no-deps" in out


@pytest.mark.integration
def test_generate_prints_completion_and_stats(capsys):
    code = main(["generate", "--method", "lagkv", "--keep-ratio", "0.25", "--lag-size", "8", "--sink-size", "4",
                 "--prompt", "List the numbers from one to forty, separated by commas: one, two,", "--raw",
                 "--max-new-tokens", "20", "--json"])
    assert code == 0
    row = json.loads(capsys.readouterr().out)
    stats = row["stats"]
    assert row["completion"].strip()
    assert stats["tokens_seen"] == row["prompt_tokens"] + 19
    assert 0 < stats["compression_ratio"] < 1 and max(stats["stored_per_layer"]) < stats["tokens_seen"]


@pytest.mark.integration
def test_prompt_longer_than_the_context_fails_early(capsys):
    assert main(["generate", "--prompt", "word " * 9000, "--raw"]) == 2
    err = capsys.readouterr().err.strip()
    assert "exceeds the model's context of 8192 tokens" in err and "\n" not in err
