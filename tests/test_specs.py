"""The one method-spec syntax (`kvtrim.specs`), the one sizing rule, and the CLI flags that use them."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import tiny_model

import kvtrim
from kvtrim.cli import main
from kvtrim.methods.base import kept_count
from kvtrim.specs import parse_method_spec, parse_method_specs


def test_syntax_types_lists_and_labels():
    spec = parse_method_spec(" lagkv:lag-size=64:skip_layers=0+1:value_weight=0.5 ")
    assert spec.name == "lagkv" and dict(spec.params) == {"lag_size": 64, "skip_layers": (0, 1), "value_weight": 0.5}
    assert spec.label == "lagkv:lag_size=64:skip_layers=0+1:value_weight=0.5"
    assert parse_method_spec(spec.label).label == spec.label  # the label is itself a spec
    method = spec.build()
    assert (method.lag_size, method.skip_layers, method.keep_ratio) == (64, (0, 1), 0.5)
    assert parse_method_spec("keydiff:budget=100").fixes_size
    assert not parse_method_spec("keydiff:block_size=64").fixes_size


@pytest.mark.parametrize("text,fragment", [
    ("", "empty method spec"),
    ("nope", "unknown method 'nope'"),
    ("lagkv:nope=3", "has no parameter 'nope'"),
    ("lagkv:lag_size", "expected param=value"),
    ("lagkv:lag_size=x", "cannot read 'x' as int"),
    ("lagkv:skip_layers=0,1", "cannot read '0,1' as list of integers"),
    ("lagkv:lag_size=1:lag_size=2", "given twice"),
    ("lagkv:lag_size=0", "lag_size must be >= 1"),  # values are checked before any work
    ("lagkv:keep_ratio=2", "keep_ratio must be in (0, 1]"),
    ("streaming:sink_size=-3", "sink_size must be >= 0"),
    ("keydiff:budget=100:compression_ratio=0.5", "exactly one"),
    ("lagkv:eps=nan", "finite"),
])
def test_bad_specs_are_one_line_errors(text, fragment):
    with pytest.raises(kvtrim.KvtrimError) as err:
        parse_method_spec(text)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_sweep_sizing_uses_one_rounding_rule():
    n, r = 1000, 0.9  # 1000 * (1 - 0.9) = 99.99999999999997: kvpress's int() gives 99
    assert kept_count(n, r) == 99 and kept_count(5, 0.99) == 1
    assert parse_method_spec("keydiff").build(n, r).budget == kept_count(n, r)
    assert parse_method_spec("keydiff").build(n, r, "ratio").compression_ratio == r
    assert parse_method_spec("tova").build(n, r, "ratio").compression_ratio == r
    assert parse_method_spec("lazyeviction:window=16").build(n, r, "ratio").budget == kept_count(n, r)  # no ratio form
    assert parse_method_spec("keydiff:budget=64").build(n, r).budget == 64  # as given
    assert parse_method_spec("streaming:budget={budget}").build(n, r).budget == 99
    assert parse_method_spec("lagkv:compression_ratio={ratio}").build(n, 0.75).compression_ratio == 0.75
    assert isinstance(parse_method_spec("full").build(n, r), kvtrim.FullCache)
    with pytest.raises(kvtrim.KvtrimError, match="fixes the size"):
        kvtrim.KeyDiff.at_budget(10, 100, compression_ratio=0.5)
    with pytest.raises(kvtrim.KvtrimError, match="out of reach"):
        parse_method_spec("lagkv").build(300, 0.75)  # a cell the method cannot reach
    with pytest.raises(kvtrim.KvtrimError, match="listed twice"):
        parse_method_specs("keydiff:block_size=8,keydiff:block-size=8")


def test_sweep_sizing_by_an_absolute_budget():
    """`--budgets`: the budget whatever the length, always at-budget; `{ratio}` = the prompt's share removed."""
    assert parse_method_spec("keydiff").build(1000, None, budget=128).budget == 128
    assert parse_method_spec("keydiff").build(1000, None, "ratio", budget=128).budget == 128  # no ratio form here
    assert parse_method_spec("h2o").build(100, None, budget=128).budget == 128  # more than the prompt: kept whole
    assert parse_method_spec("lazyeviction:window=9").build(1000, None, budget=384).budget == 384
    assert parse_method_spec("lagkv:compression_ratio={ratio}").build(1000, None, budget=250).compression_ratio == 0.75
    lag = parse_method_spec("lagkv:lag_size=64").build(445, None, budget=384)
    assert lag.keep_ratio == kvtrim.LagKV.at_budget(384, 445, lag_size=64).keep_ratio
    with pytest.raises(kvtrim.KvtrimError, match="a compression ratio or a budget"):
        parse_method_spec("keydiff").build(1000, 0.5, budget=128)
    with pytest.raises(kvtrim.KvtrimError, match="must exceed window"):
        parse_method_spec("lazyeviction").build(1000, None, budget=128)  # window 128: the cell is skipped


def test_every_command_takes_the_same_spec(tmp_path, capsys):
    # generate: the spec, plus per-parameter flags as sugar (a parameter given both ways is refused)
    assert main(["generate", "--method", "lagkv:lag_size=0", "--prompt", "x"]) == 2
    assert "lag_size must be >= 1" in capsys.readouterr().err
    assert main(["generate", "--method", "lagkv:lag_size=64", "--lag-size", "32", "--prompt", "x"]) == 2
    assert "given twice" in capsys.readouterr().err
    # eval and bench: the same parser, the same errors, before any model is loaded
    for argv in (["eval", "--out", str(tmp_path / "e")], ["bench", "--out", str(tmp_path / "b")]):
        assert main([*argv, "--methods", "lagkv:lag_size=0"]) == 2
        assert "lag_size must be >= 1" in capsys.readouterr().err


def test_no_flag_abbreviations():
    assert main(["eval", "--method", "lagkv"]) == 2  # not silently taken as --methods
    assert main(["bench", "--length", "512"]) == 2


def test_pending_attention_handoff_does_not_keep_a_deleted_cache_alive():
    model = tiny_model("llama")  # stock SDPA: the hand-off never happens
    cache = kvtrim.TrimCache(kvtrim.LagKV(sink_size=2, lag_size=4), config=model.config)
    with torch.no_grad():
        model(torch.randint(0, 200, (1, 20)), cache=cache)
    layer = weakref.ref(cache.layers[-1])
    del cache
    gc.collect()
    assert layer() is None


def test_layer_indices_beyond_the_model_are_refused_before_weights(tmp_path, capsys, monkeypatch):
    import kvtrim.models

    monkeypatch.setattr(kvtrim.models, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    for argv in (["generate", "--method", "lagkv:skip_layers=0+99", "--prompt", "x"],
                 ["eval", "--methods", "lagkv:skip_layers=99", "--out", str(tmp_path / "e"), "--no-plots"],
                 ["bench", "--methods", "lagkv:skip_layers=99", "--out", str(tmp_path / "b"), "--no-plots"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "skip_layers [99] beyond the model's 30 layers" in err and "\n" not in err, argv
    model = tiny_model("llama")
    with pytest.raises(kvtrim.KvtrimError, match="beyond the model's 2 layers"):
        kvtrim.TrimCache(kvtrim.LagKV(skip_layers=(5,)), config=model.config)


def test_wrapper_spec_takes_a_sweep_budget():
    """An `eval --budgets` cell sizes a wrapper's method with that budget (not a ratio's kept count), and a
    ratio cell with the ratio's kept count."""
    spec = parse_method_spec("adakv:method=snapkv")
    assert spec.build(1000, budget=128).method.budget == 128
    assert spec.build(1000, 0.75).method.budget == kept_count(1000, 0.75)
