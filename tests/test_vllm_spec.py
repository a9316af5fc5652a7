"""Which methods kvtrim's vLLM worker runs, and the one-line refusals (no vLLM needed: runs in .venv too)."""

import pytest

from kvtrim import KeyDiff, KNorm, KvtrimError, LagKV, StreamingLLM
from kvtrim.vllm.spec import method_for_vllm


@pytest.mark.parametrize("text, cls", [
    ("lagkv:compression_ratio=0.5", LagKV), ("keydiff:compression_ratio=0.75", KeyDiff),
    ("streaming:compression_ratio=0.5", StreamingLLM), ("knorm:compression_ratio=0.5", KNorm),
])
def test_ratio_modes_run(text, cls):
    method = method_for_vllm(text)
    assert type(method) is cls and method.compression_ratio is not None


def test_full_evicts_nothing():
    assert method_for_vllm("full") is None


@pytest.mark.parametrize("text, words", [
    ("nope", "unknown method 'nope'"),
    ("lagkv", "reference mode"),
    ("keydiff:budget=64", "evicts during decoding"),
    ("streaming:budget=64", "evicts during decoding"),
    ("snapkv:compression_ratio=0.5", "queries"),
    ("h2o:budget=64", "queries or attention"),
    ("kvzip:compression_ratio=0.5", "queries"),
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
