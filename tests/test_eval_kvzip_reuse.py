"""KVzip's scores are computed once per context in a sweep and reused at every ratio and budget: the rows
are identical to recomputing them (float32), and the scoring passes run once instead of once per setting."""

from __future__ import annotations

import pytest
from conftest import tiny_model

import sys

import kvtrim.eval.kvzip_reuse as reuse_module
from kvtrim.attention import enable
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.runner import Runner, RunSettings, plan
from kvtrim.eval.tasks import generate_samples
from kvtrim.specs import parse_method_specs

HOW = ("seconds", "prefill_reused", "kvzip_scores_shared", "context_group")  # how a row was computed


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def model():
    return enable(tiny_model("llama", vocab=49152, layers=2))


def _content(rows):
    return {r["key"]: {k: v for k, v in r.items() if k not in HOW} for r in rows}


@pytest.mark.parametrize("specs", [["full", "kvzip", "kvzip:level=head", "streaming"], ["kvzip"]])
def test_shared_scores_give_the_recomputed_rows(model, tok, tmp_path, monkeypatch, specs):
    samples = generate_samples("niah_single_1", PromptFormat(tok), 300, 2, seed=2)
    jobs = plan(samples, parse_method_specs(specs), [0.5, 0.75], [64])
    passes = []
    compress_module = sys.modules["kvtrim.compress"]  # the package's `kvtrim.compress` is the function
    real = compress_module.run_scoring_passes

    def counting(model, cache, inputs):
        passes.append(int(bool(inputs)))  # compress calls it for every method, with no passes for most
        return real(model, cache, inputs)

    monkeypatch.setattr(compress_module, "run_scoring_passes", counting)
    monkeypatch.setattr(reuse_module, "run_scoring_passes", counting)
    settings = RunSettings(model="tiny", max_new_tokens=4, stop_when_answered=False)
    shared = Runner(model, tok, settings, str(tmp_path / "shared"), progress=False).run(jobs)
    n_kvzip = sum(s.startswith("kvzip") for s in specs)
    # one scoring run per sample and scoring configuration (level does not change the scores), not per setting
    assert sum(passes) == 2  # per sample once (level does not change the scores), not per spec and setting
    assert all(r["kvzip_scores_shared"] == 3 * n_kvzip for r in shared if r["method_name"] == "kvzip")
    passes.clear()
    recomputed = Runner(model, tok, RunSettings(model="tiny", max_new_tokens=4, stop_when_answered=False,
                                                reuse_prefill=False), str(tmp_path / "again"), progress=False).run(jobs)
    assert sum(passes) == 2 * 3 * n_kvzip  # every (sample, kvzip spec, setting) scores anew
    assert _content(shared) == _content(recomputed) and len(shared) == len(jobs)
    assert any(r["achieved_compression"] > 0.4 for r in shared if r["method_name"] == "kvzip")
