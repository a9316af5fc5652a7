"""`kvtrim eval --batch-size N`: batched rows equal the rows run one sample at a time (greedy, float32).

The references are the batch-1 paths themselves (`greedy_decode` on a sequence alone, `Runner` with
`batch_size=1`), which compress and decode each sample on its own."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import tiny_model

from kvtrim.attention import enable
from kvtrim.compress import compress
from kvtrim.decoding import greedy_decode, greedy_decode_batch
from kvtrim.eval.jsonl import read_jsonl
from kvtrim.eval.prompt import PromptFormat
from kvtrim.eval.runner import RESULTS, RUN_FILE, Runner, RunSettings, check_run_settings, pending_units, plan
from kvtrim.eval.sample import Sample
from kvtrim.methods import METHODS, StreamingLLM
from kvtrim.methods.base import KvtrimError
from kvtrim.specs import parse_method_specs

# every registered method, with parameters that make it evict on ~270-token prompts
SPECS = {
    "lagkv": "lagkv:sink_size=4:lag_size=16", "keydiff": "keydiff:block_size=32", "snapkv": "snapkv:window=8",
    "lazyeviction": "lazyeviction:window=4", "adakv": "adakv:method=snapkv:window=8",
}
HOW = ("seconds", "prefill_reused", "batch_size", "kvzip_scores_shared", "context_group")  # how a row was computed, not what it holds
WORDS = "the grass is green and the sky is blue here we go again".split()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama (GQA 4/2) whose vocabulary covers the SmolLM2 tokenizer, on kvtrim attention."""
    return enable(tiny_model("llama", vocab=49152, layers=2))


def _sample(i: int) -> Sample:
    """Prompts of equal token counts (a 5-digit key in the same filler), answers of different lengths."""
    filler = " ".join(WORDS[(j * 7 + i) % len(WORDS)] for j in range(120))
    rest = " ".join(WORDS[(j * 5 + i) % len(WORDS)] for j in range(100))
    key = str(10000 + 1111 * i)
    return Sample(id=f"key-{i}", task="key", context=f"{filler} The pass key is {key}. Remember it. {rest}",
                  question="What is the pass key?", answers=[key], max_new_tokens=3 + i, length=300)


@pytest.fixture(scope="module")
def samples(tok):
    samples = [_sample(i) for i in range(4)]
    fmt = PromptFormat(tok)
    assert len({tuple(x.shape[-1] for x in fmt.encode(s)) for s in samples}) == 1  # the test's premise
    return samples


def _specs(names=None):
    return parse_method_specs([SPECS.get(n, n) for n in (names or METHODS)])


def _run(model, tok, samples, out, batch_size, specs, ratios=(0.5,), budgets=(48,), **settings):
    settings = RunSettings(model="tiny", batch_size=batch_size, **settings)
    runner = Runner(model, tok, settings, str(out), progress=False)
    return runner.run(plan(samples, specs, list(ratios), list(budgets)))


def _content(rows: list[dict]) -> dict[str, dict]:
    return {r["key"]: {k: v for k, v in r.items() if k not in HOW} for r in rows}


def _assert_same_rows(batched: list[dict], alone: list[dict]) -> None:
    a, b = _content(batched), _content(alone)
    assert a.keys() == b.keys()
    for key in b:
        diff = {f: (a[key].get(f), b[key].get(f)) for f in set(a[key]) | set(b[key]) if a[key].get(f) != b[key].get(f)}
        assert not diff, (key, diff)


# ---- the decoding loop ---------------------------------------------------------------------------------
def test_batched_greedy_decoding_follows_each_rows_own_rules():
    """Each row stops as `greedy_decode` alone would: at a stop token, at its own `done`, at its own cap;
    the cache is watched after exactly the forwards `greedy_decode` runs, and read when a row stops."""
    model = enable(tiny_model("llama"))
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, 40))
    method = lambda: StreamingLLM(sink_size=4, budget=16)  # noqa: E731  (evicts while decoding)
    free = [greedy_decode(model, (c := compress(model, ids[i:i + 1], method())).cache, c.logits, 8, set())
            for i in range(3)]
    stop = {free[0][2]}  # row 0 meets a stop token at its third step (it may meet it earlier too)
    caps = [8, 8, 5]
    done = [None, lambda t: len(t) == 3, None]  # row 1 is answered after three tokens
    alone, watched = [], []
    for i in range(3):
        ctx = compress(model, ids[i:i + 1], method())
        trace = []
        tokens = greedy_decode(model, ctx.cache, ctx.logits, caps[i], stop, done[i],
                               lambda c=ctx.cache, t=trace: t.append(c.layers[0].seen))
        alone.append(tokens)
        watched.append(trace)
    assert len(alone[0]) < 3 and len(alone[1]) == 3 and len(alone[2]) == 5  # each rule was used

    ctx = compress(model, ids, method())
    traces, ends = [[] for _ in range(3)], {}
    tokens = greedy_decode_batch(model, ctx.cache, ctx.logits, caps, stop, done,
                                 lambda fed: [traces[i].append(ctx.cache.layers[0].seen) for i in fed],
                                 lambda i: ends.setdefault(i, ctx.cache.layers[0].seen))
    assert tokens == alone
    assert traces == watched
    assert ends == {i: 40 + len(watched[i]) for i in range(3)}  # read before any later forward
    with pytest.raises(KvtrimError, match="one max_new_tokens"):
        greedy_decode_batch(model, ctx.cache, ctx.logits, [4, 4], stop)


# ---- the sweep ----------------------------------------------------------------------------------------
def test_batched_sweep_rows_equal_batch_one_for_every_method(model, tok, samples, tmp_path):
    """Every registered method, at a ratio and at a budget: batches of 3 (and a lone sample) give the
    rows of batch 1, field for field (cache stats and traces included)."""
    specs = _specs()
    alone = _run(model, tok, samples, tmp_path / "b1", 1, specs)
    batched = _run(model, tok, samples, tmp_path / "b3", 3, specs)
    _assert_same_rows(batched, alone)
    assert all("batch_size" not in r for r in alone)
    sizes = [r.get("batch_size", 1) for r in batched if "skipped" not in r]
    assert sizes.count(3) >= len(sizes) // 2, sizes  # most rows really ran in batches
    assert any(r.get("prefill_reused") and r.get("batch_size") == 3 for r in batched)  # a shared batched prefill
    evicting = [r for r in alone if "skipped" not in r and r["achieved_compression"] > 0.3]
    assert len({r["method_name"] for r in evicting}) >= 5  # the methods did evict: the test compares something


def test_batched_query_aware_chunked_and_no_reuse(model, tok, samples, tmp_path):
    """The other protocols: the question compressed with the context; a chunked prefill; no reuse."""
    specs = _specs(["full", "snapkv", "streaming", "keydiff"])
    for name, settings in {"qa": dict(query_aware=True), "chunked": dict(prefill_chunk_size=64),
                           "fresh": dict(reuse_prefill=False)}.items():
        alone = _run(model, tok, samples[:3], tmp_path / f"{name}1", 1, specs, ratios=(0.7,), budgets=(), **settings)
        batched = _run(model, tok, samples[:3], tmp_path / f"{name}3", 3, specs, ratios=(0.7,), budgets=(), **settings)
        _assert_same_rows(batched, alone)
        assert all(r.get("batch_size") == 3 for r in batched), name


def test_unequal_configurations_run_in_separate_batches(model, tok, samples, tmp_path):
    """At a ratio in the at-budget form each method is sized from its own prompt: a sample with a longer
    prompt gets another budget, so it runs apart from the others; the rows still equal batch 1's."""
    longer = Sample(**{**vars(_sample(3)), "id": "key-long", "context": _sample(3).context + " and more words"})
    group = samples[:2] + [longer]
    specs = _specs(["streaming"])
    alone = _run(model, tok, group, tmp_path / "b1", 1, specs, budgets=())
    batched = _run(model, tok, group, tmp_path / "b3", 3, specs, budgets=())
    _assert_same_rows(batched, alone)
    assert [r.get("batch_size", 1) for r in batched] == [2, 2, 1]
    assert batched[2]["budget"] != batched[0]["budget"]


def test_resume_reruns_only_the_missing_rows_of_a_batch(model, tok, samples, tmp_path):
    specs = _specs(["full", "streaming", "snapkv"])
    whole = _run(model, tok, samples, tmp_path, 4, specs, budgets=())
    path = os.path.join(tmp_path, RESULTS)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    gone = {json.loads(lines[i])["key"] for i in (1, 5, 6)}
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for i, line in enumerate(lines) if i not in (1, 5, 6)))
    jobs = plan(samples, specs, [0.5])
    assert {job.key for unit in pending_units(str(tmp_path), jobs, 4) for job in unit} == gone
    ran = []
    original_batch, original_job = Runner.run_batch, Runner.run_job

    def spy_batch(self, jobs, *args):
        ran.extend(job.key for job in jobs)
        return original_batch(self, jobs, *args)

    def spy_job(self, job, *args):
        ran.append(job.key)
        return original_job(self, job, *args)

    Runner.run_batch, Runner.run_job = spy_batch, spy_job
    try:
        again = _run(model, tok, samples, tmp_path, 4, specs, budgets=())
    finally:
        Runner.run_batch, Runner.run_job = original_batch, original_job
    assert sorted(ran) == sorted(gone)
    _assert_same_rows(again, whole)


def test_batch_size_is_recorded_and_does_not_block_a_resume(tmp_path):
    check_run_settings(str(tmp_path), RunSettings(model="tiny", batch_size=4))
    with open(os.path.join(tmp_path, RUN_FILE), encoding="utf-8") as f:
        assert json.load(f)["batch_size"] == 4
    check_run_settings(str(tmp_path), RunSettings(model="tiny", batch_size=1))  # the same rows: allowed
    with pytest.raises(KvtrimError, match="other settings"):
        check_run_settings(str(tmp_path), RunSettings(model="tiny", batch_size=4, max_new_tokens=3))


@pytest.mark.parametrize("value", ["0", "-2"])
def test_batch_size_below_one_is_a_one_line_error(value, capsys, tmp_path):
    from kvtrim.cli import main

    code = main(["eval", "--tasks", "passkey", "--batch-size", value, "--no-plots", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"kvtrim: error: --batch-size must be >= 1, got {value}"
    assert not os.path.exists(tmp_path / "o")


def test_invocations_record_the_batch_size(monkeypatch, model, tok, tmp_path, capsys):
    import kvtrim.models
    from kvtrim.cli import main

    monkeypatch.setattr(kvtrim.models, "load_model", lambda *a, **k: (model, tok))
    out = str(tmp_path / "o")
    argv = ["eval", "--tasks", "passkey", "--lengths", "300", "--samples", "1", "--depths", "0.2,0.8",
            "--methods", "full,streaming", "--compression-ratios", "0.5", "--max-new-tokens", "3", "--no-plots",
            "--quiet", "--out", out]
    assert main([*argv, "--batch-size", "2"]) == 0
    runs = read_jsonl(os.path.join(out, "invocations.jsonl"))
    assert [r["batch_size"] for r in runs] == [2]
    assert "batches of 2" in open(os.path.join(out, "summary.md"), encoding="utf-8").read()


# ---- padded batches -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ragged_samples(tok):
    """Prompts and questions of different lengths (a padded batch)."""
    samples = [_sample(0), _sample(1)]
    samples.append(Sample(**{**vars(_sample(2)), "context": _sample(2).context + " and some more words here"}))
    samples.append(Sample(**{**vars(_sample(3)), "context": _sample(3).context[:-40],
                             "question": "Tell me: what is the pass key that was given?"}))
    fmt = PromptFormat(tok)
    lengths = [tuple(x.shape[-1] for x in fmt.encode(s)) for s in samples]
    assert len({n for n, _ in lengths}) == 3 and len({m for _, m in lengths}) == 2, lengths  # the premise
    return samples


@pytest.mark.parametrize("compression", ["ratio", "at-budget"])
def test_padded_batches_give_the_rows_of_batch_one(model, tok, ragged_samples, compression, tmp_path):
    """Every registered method on prompts of different lengths; methods sized by `--compression ratio` or
    an absolute budget share one configuration, so they run as one padded batch of 4 (where the method
    can take one: KVzip's scoring passes cannot, it batches prompts of equal lengths only)."""
    specs = _specs()
    ratios, budgets = ((0.5,), ()) if compression == "ratio" else ((), (48,))
    settings = dict(compression=compression, reuse_prefill=False)  # with reuse, see the next test
    alone = _run(model, tok, ragged_samples, tmp_path / "b1", 1, specs, ratios, budgets, **settings)
    batched = _run(model, tok, ragged_samples, tmp_path / "b4", 4, specs, ratios, budgets, **settings)
    _assert_same_rows(batched, alone)
    padded = {r["method_name"] for r in batched if r.get("batch_size") == 4}
    assert len(padded) >= 6, padded
    # KVzip: only its two samples of equal lengths share a batch
    assert sorted(r.get("batch_size", 1) for r in batched if r["method_name"] == "kvzip") == [1, 1, 2, 2]
    evicting = {r["method_name"] for r in alone if "skipped" not in r and r["achieved_compression"] > 0.3}
    assert len(evicting & padded) >= 4, (evicting, padded)


def test_with_prefill_reuse_replaying_methods_run_alone_in_a_padded_unit(model, tok, ragged_samples, tmp_path):
    """A padded batch is prefilled by its method itself: methods that replay a shared prefill would lose
    it, so they run one sample at a time (replaying it, as batch 1 does); block-wise ones batch."""
    specs = _specs(["full", "snapkv", "streaming", "keydiff"])
    alone = _run(model, tok, ragged_samples, tmp_path / "b1", 1, specs, (), (48,))
    batched = _run(model, tok, ragged_samples, tmp_path / "b4", 4, specs, (), (48,))
    _assert_same_rows(batched, alone)
    for row in batched:
        if row["method_name"] == "keydiff":  # block-wise: nothing to replay
            assert row.get("batch_size") == 4 and not row["prefill_reused"]
        else:
            assert "batch_size" not in row and row["prefill_reused"], row["key"]


def test_padded_batches_query_aware_and_chunked(model, tok, ragged_samples, tmp_path):
    specs = _specs(["full", "snapkv", "streaming", "keydiff", "lagkv"])
    for name, settings in {"qa": dict(query_aware=True, reuse_prefill=False),
                           "chunked": dict(prefill_chunk_size=64)}.items():
        alone = _run(model, tok, ragged_samples, tmp_path / f"{name}1", 1, specs, (), (40,), **settings)
        batched = _run(model, tok, ragged_samples, tmp_path / f"{name}4", 4, specs, (), (40,), **settings)
        _assert_same_rows(batched, alone)
        # LagKV's at-budget form (its keep_ratio) depends on the prompt's length: not one configuration
        assert all(r.get("batch_size") == 4 for r in batched if r["method_name"] != "lagkv"), name


@pytest.mark.integration
def test_real_model_padded_batch_gives_the_rows_of_batch_one(smollm, tmp_path):
    """SmolLM2 (float32): a NIAH depth grid (prompts of different lengths) in one padded batch of 4 per
    method gives the rows of one sample at a time (answers, scores, cache statistics)."""
    from kvtrim.eval.tasks import generate_samples

    model, tok = smollm
    enable(model)
    samples = generate_samples("niah", PromptFormat(tok), 300, 1, seed=0, depths=(0.0, 0.3, 0.6, 1.0))
    assert len({PromptFormat(tok).encode(s)[0].shape[-1] for s in samples}) > 1  # padded
    specs = _specs(["full", "snapkv", "streaming"])
    rows = {}
    for size in (1, 4):  # no reuse: every method in padded batches (see the replay rule)
        settings = RunSettings(model="smollm2-135m", max_new_tokens=10, batch_size=size, reuse_prefill=False)
        rows[size] = Runner(model, tok, settings, str(tmp_path / str(size)), progress=False).run(
            plan(samples, specs, [], [48]))
    _assert_same_rows(rows[4], rows[1])
    assert all(r.get("batch_size") == 4 for r in rows[4])
    assert sum(r["score"] for r in rows[1] if r["method"] == "full") >= 3  # the model answers: a real test
    assert any(r["achieved_compression"] > 0.5 for r in rows[1])
