"""Which methods kvtrim's vLLM worker runs, and the one-line refusals (no vLLM needed: runs in .venv too)."""

import pytest

from kvtrim import H2O, TOVA, KeyDiff, KNorm, KvtrimError, LagKV, LazyEviction, SnapKV, StreamingLLM
from kvtrim.vllm.spec import method_for_vllm


@pytest.mark.parametrize("text, cls", [
    ("lagkv:compression_ratio=0.5", LagKV), ("keydiff:compression_ratio=0.75", KeyDiff),
    ("streaming:compression_ratio=0.5", StreamingLLM), ("knorm:compression_ratio=0.5", KNorm),
    ("snapkv:compression_ratio=0.5", SnapKV), ("snapkv:compression_ratio=0.75:window=8:kernel=5", SnapKV),
])
def test_ratio_modes_run(text, cls):
    method = method_for_vllm(text)
    assert type(method) is cls and method.compression_ratio is not None


@pytest.mark.parametrize("text, block", [("snapkv:budget=64", None), ("snapkv:budget=64:window=16:block_size=128", 128)])
def test_snapkv_budget_runs(text, block):  # queries at each prompt block's end (the prompt is one block without block_size)
    method = method_for_vllm(text)
    assert type(method) is SnapKV and method.budget == 64 and method.prefill_block_size() == block


@pytest.mark.parametrize("text, cls", [
    ("lagkv", LagKV), ("lagkv:keep_ratio=0.25:lag_size=64", LagKV), ("keydiff:budget=64", KeyDiff),
    ("streaming:budget=64", StreamingLLM), ("knorm:budget=64", KNorm),
])
def test_decoding_modes_run(text, cls):  # methods that evict while decoding (reference and budget modes)
    method = method_for_vllm(text)
    assert type(method) is cls and method.compression_ratio is None


@pytest.mark.parametrize("text, cls", [("tova:budget=64", TOVA), ("tova:compression_ratio=0.5", TOVA),
                                       ("h2o:budget=64", H2O), ("h2o:heavy_budget=8:recent_budget=8", H2O),
                                       ("lazyeviction:budget=512", LazyEviction),
                                       ("lazyeviction:budget=64:window=16:gqa=per_query_head", LazyEviction)])
def test_decode_attention_methods_run(text, cls):  # the prompt's queries, then each due step's probabilities
    assert type(method_for_vllm(text)) is cls


def test_full_evicts_nothing():
    assert method_for_vllm("full") is None


@pytest.mark.parametrize("text, words", [
    ("nope", "unknown method 'nope'"),
    ("snapkv:compression_ratio=0.5:block_size=64", "block_size= needs budget="),
    ("kvzip:compression_ratio=0.5", "scoring passes"),
    ("adakv:method=snapkv:compression_ratio=0.5", "different number of entries per KV head"),
    ("adakv:method=keydiff:compression_ratio=0.5", "different number of entries per KV head"),
    ("lagkv:compression_ratio=0.5:skip_layers=0", "skip_layers"),
    ("lagkv:compression_ratio=1.5", "compression_ratio"),
    ("keydiff:compression_ratio=0.5:bogus=1", "bogus"),
])
def test_refused_in_one_line(text, words):
    with pytest.raises(KvtrimError) as err:
        method_for_vllm(text)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("value", [3, ["lagkv"], None])
def test_not_a_string(value):  # vllm_xargs values may be numbers or lists
    with pytest.raises(KvtrimError, match="spec string"):
        method_for_vllm(value)


def test_installed_methods_are_found(monkeypatch):
    """A method an installed package registers through the `kvtrim.methods` entry point runs in the engine
    without any import by the user (every server process loads the entry points before its first spec)."""
    import os
    import sys

    from kvtrim.methods import METHODS
    from kvtrim.vllm import spec

    folder = os.path.join(os.path.dirname(__file__), "data", "contract_breaker")
    monkeypatch.syspath_prepend(folder)
    monkeypatch.setattr(spec, "_registered", spec._registered.__wrapped__)  # load them again, here
    spec._method.cache_clear()
    try:
        assert "width_dependent" not in METHODS
        method = method_for_vllm("width_dependent:compression_ratio=0.5")
        assert type(method).__name__ == "WidthDependent" and method.compression_ratio == 0.5
    finally:
        METHODS.pop("width_dependent", None)
        METHODS.pop("raises_in_score", None)
        sys.modules.pop("kvtrim_contract_breaker", None)
        spec._method.cache_clear()


@pytest.mark.parametrize("flags, words", [
    (["--kv-transfer-config", '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'], "--kv-transfer-config"),
    (["--kv_transfer_config.kv_connector=ExampleConnector"], "--kv-transfer-config"),  # vLLM reads it so too
    (["--kv-offloading-size", "4"], "--kv-offloading-size"),
    (["--speculative-config={}"], "--speculative-config"),
    (["-pp", "2"], "-pp"),
])
def test_serve_refuses_what_compaction_breaks_in_one_line(capsys, flags, words):
    pytest.importorskip("vllm", reason="kvtrim serve needs vLLM's CPU build (.venv-serve)")
    from kvtrim.cli import main

    assert main(["serve", "--model", "smollm2-135m", *flags, "--dry-run"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"kvtrim: error: kvtrim serve refuses {words}: ")
    assert out.err.count("\n") == 1


def test_serve_hands_method_and_admission_to_vllm(capsys):
    """`kvtrim serve --dry-run` prints the vLLM command: the server's method and admission go to the scheduler
    and worker through `--additional-config`; a bad admission is one argparse line."""
    pytest.importorskip("vllm", reason="kvtrim serve needs vLLM's CPU build (.venv-serve)")
    from kvtrim.cli import main

    assert main(["serve", "--model", "smollm2-135m", "--method", "keydiff:budget=64", "--admission", "vllm",
                 "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert """--additional-config {"kvtrim_method": "keydiff:budget=64", "kvtrim_admission": "vllm"}""" in line
    assert main(["serve", "--model", "smollm2-135m", "--dry-run"]) == 0
    assert '"kvtrim_admission": "peak"' in capsys.readouterr().out
    assert main(["serve", "--model", "smollm2-135m", "--admission", "lazy", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--admission: invalid choice: 'lazy'" in err[0]


def test_the_platform_plugin_is_kvtrim_serves_alone(monkeypatch):
    """kvtrim's `vllm.platform_plugins` entry point names its platform (the front end's 400 for a request that
    can never fit the pool) only in a `kvtrim serve` server's environment: plain vLLM in the same environment keeps
    vLLM's own CPU platform."""
    pytest.importorskip("vllm", reason="needs vLLM's CPU build (.venv-serve)")
    import importlib.metadata

    from kvtrim.vllm import SERVE_ENV
    from kvtrim.vllm.plugin import platform

    found = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.platform_plugins")}
    assert found.get("kvtrim") == "kvtrim.vllm.plugin:platform"
    monkeypatch.delenv(SERVE_ENV, raising=False)
    assert platform() is None
    monkeypatch.setenv(SERVE_ENV, "1")
    assert platform() == "kvtrim.vllm.platform.TrimCpuPlatform"
    from kvtrim.vllm.platform import TrimCpuPlatform
    from vllm.platforms.cpu import CpuPlatform

    assert issubclass(TrimCpuPlatform, CpuPlatform)


def test_a_method_fed_attention_runs_whatever_its_class():
    """The engine hands any method that needs attention what kvtrim's attention hands it in transformers (each
    decode step's probabilities): a subclass of a built-in ranking, or an `EvictionMethod` deciding in
    `on_attention` (as LazyEviction does), is not refused for its class."""
    from dataclasses import dataclass

    from kvtrim.methods.base import EvictionMethod
    from kvtrim.specs import parse_method_spec
    from kvtrim.vllm.spec import refusal

    @dataclass(kw_only=True)
    class Recent(EvictionMethod):  # keeps the newest `budget` entries once over, decided from attention's shape
        name = "recent-test"
        needs_attention = True
        budget: int = 8

    class MyTOVA(TOVA):
        name = "mytova-test"

    assert refusal(Recent()) is None and refusal(MyTOVA(budget=8)) is None
    assert "scoring passes" in refusal(parse_method_spec("kvzip:compression_ratio=0.5").build())


def test_queries_after_the_prompt_are_refused():
    """A ranking method that reads queries (not attention) at decode steps: the worker hands queries after the
    prompt only to methods that need attention."""
    from kvtrim.methods.base import Schedule
    from kvtrim.vllm.spec import refusal

    class DecodingSnapKV(SnapKV):
        def schedule(self):
            return Schedule(prefill="block", decode_slack=8)

    why = refusal(DecodingSnapKV(budget=64))
    assert "queries at appends or decode steps" in why and "\n" not in why


def test_the_engine_reads_the_methods_declarations():
    """What the engine needs from a method is declared on it, not inferred from its class: H2O gets its prompt's
    attention sums (`prompt_attention_summary = "sums"`), so does a registered method declaring them, AdaKV is
    refused (`same_count_per_head = False`), and so is any method declaring so or an unknown summary."""
    from dataclasses import dataclass

    from kvtrim import AdaKV
    from kvtrim.vllm.spec import prompt_queries, prompt_sums, refusal

    h2o = method_for_vllm("h2o:budget=64")
    assert prompt_sums(h2o) and prompt_queries(h2o) == 0 and not prompt_sums(None)  # None: `full`
    assert not prompt_sums(method_for_vllm("tova:budget=64")) and prompt_queries(method_for_vllm("tova:budget=64"))

    @dataclass(kw_only=True)
    class SummedTOVA(TOVA):  # a registered ranking method fed its prompt's attention as sums
        name = "summed-tova-test"
        prompt_attention_summary = "sums"

    assert refusal(SummedTOVA(budget=8)) is None and prompt_sums(SummedTOVA(budget=8))
    assert prompt_queries(SummedTOVA(budget=8)) == 0

    class Unknown(TOVA):
        name = "unknown-summary-test"
        prompt_attention_summary = "maxima"

    assert "prompt_attention_summary 'maxima'" in refusal(Unknown(budget=8))

    class PerHead(KNorm):  # a ranking method that declares per-head counts is refused as AdaKV is
        name = "per-head-test"
        same_count_per_head = False

    assert not AdaKV.same_count_per_head and KNorm.same_count_per_head
    for method in (PerHead(budget=8), AdaKV(SnapKV(compression_ratio=0.5))):
        assert "different number of entries per KV head" in refusal(method)


@pytest.mark.parametrize("text, shares", [
    ("keydiff:compression_ratio=0.75", True), ("lagkv:compression_ratio=0.75", True), ("knorm:compression_ratio=0.5", True),
    ("streaming:compression_ratio=0.75", True), ("lagkv:keep_ratio=0.25", False), ("keydiff:budget=64", False),
    ("streaming:budget=64", False), ("knorm:budget=64", True),
])
def test_a_shared_context_is_never_written_after_it_ends(text, shares):
    """`shares_context` against `TrimCache` (the method as `model.generate` runs it, random keys): a 200-token
    context, then an append of 30 and 60 decode steps. A method that shares its compressed context keeps the
    context's kept entries where they are and evicts nothing after it; every other one evicts or moves them."""
    import torch

    from kvtrim.cache import TrimCache
    from kvtrim.methods.base import Phase
    from kvtrim.vllm.spec import shares_context

    method = method_for_vllm(text)
    cache = TrimCache(method)
    gen = torch.Generator().manual_seed(0)

    def feed(phase, n, ends_prompt=False):
        with cache.phase(phase, ends_prompt=ends_prompt):
            cache.update(*torch.randn(2, 1, 2, n, 16, generator=gen), 0)

    feed(Phase.PREFILL, 200, ends_prompt=True)
    context = cache.layers[0].kept_positions().clone()
    evictions = cache.layers[0].evictions
    feed(Phase.APPEND, 30)
    for _ in range(60):
        feed(Phase.DECODE, 1)
    layer = cache.layers[0]
    unchanged = layer.evictions == evictions and torch.equal(layer.kept_positions()[..., :context.shape[-1]], context)
    assert shares_context(method) is shares and unchanged is shares


@pytest.mark.parametrize("text", ["snapkv:compression_ratio=0.75", "snapkv:budget=64"])
def test_snapkvs_context_is_shared(text):  # its queries are read once, at the context's end
    from kvtrim.vllm.spec import shares_context

    assert shares_context(method_for_vllm(text))


@pytest.mark.parametrize("text", ["tova:compression_ratio=0.5", "h2o:compression_ratio=0.5", "lazyeviction:budget=512"])
def test_methods_fed_decode_attention_never_share_a_context(text):  # they evict or update state at decode steps
    from kvtrim.vllm.spec import shares_context

    assert not shares_context(method_for_vllm(text)) and not shares_context(None)
