"""The method contract, checked the same way for every registered method and for a user-defined one.

Each check runs every method through one protocol on tiny random float32 models (no special cases per
method beyond the spec that makes it evict on a ~150-token prompt). The per-method reference tests
(test_lagkv.py, test_keydiff.py, ...) check each kept set against a slow reference; this module checks
that every method behaves consistently across protocols: keep-everything exactness, the query-agnostic
protocol, compress-once / ask-many, batches, one-shot vs block-wise prefill, sizing and bad parameters.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_padded import rows
from transformers import DynamicCache

import kvtrim
from kvtrim.methods import METHODS
from kvtrim.methods.base import Phase, kept_count, param_type
from kvtrim.specs import parse_method_spec
from kvtrim.storage import DenseKV, RaggedKV, SlotKV

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    """The custom-method example of the README (between its `example: custom-method` markers)."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- example: custom-method -->\s*```python\n(.*?)```", text, re.S)
    assert block, "README lost its custom-method example"
    return block.group(1)


# the README's own example, run as written: a user-defined ScoringMethod registered by name
_namespace: dict = {}
exec(compile(readme_example(), "README.md", "exec"), _namespace)  # noqa: S102
USER_METHOD = _namespace["ValueNorm"]

# parameters that make each built-in evict on ~150-token prompts (user methods: their defaults)
SPEC_PARAMS = {
    "lagkv": ":sink_size=4:lag_size=16", "keydiff": ":block_size=32", "snapkv": ":window=8",
    "lazyeviction": ":window=16", "kvzip": ":chunk_size=64", "adakv": ":method=snapkv:window=8",
}
NAMES = list(METHODS)  # every registered method, the README's ValueNorm included
PROMPT, QUESTION, NEW = 150, 12, 6


def spec_for(name: str):
    return parse_method_spec(name + SPEC_PARAMS.get(name, ""))


def ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


# a vocabulary that covers the default tokenizer: methods with scoring passes (KVzip) build their
# inputs with it; the prompts themselves are random ids
VOCAB = 49152


@pytest.fixture(scope="module")
def model():
    return kvtrim.enable(tiny_model("qwen2", q_heads=6, kv_heads=2, layers=2, vocab=VOCAB))


@pytest.fixture(scope="module")
def eager_model():
    return kvtrim.enable(tiny_model("qwen2", q_heads=6, kv_heads=2, layers=2, vocab=VOCAB,
                                    attn_implementation="eager"))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvtrim.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))


def greedy(model, cache, input_ids, new=NEW):
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), cache=cache, max_new_tokens=new,
                         do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, input_ids.shape[-1]:], torch.stack(out.scores)


def trim_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, kvtrim.TrimLayer)]


def test_the_readme_method_is_registered():
    assert METHODS["valuenorm"] is USER_METHOD and issubclass(USER_METHOD, kvtrim.ScoringMethod)
    # a ranking method is a few lines: only `score`, no hook of its own
    hooks = ("on_update", "on_attention", "on_prompt_end", "select", "target", "schedule")
    for cls in (USER_METHOD, kvtrim.KNorm):
        assert not any(h in vars(cls) for h in hooks), cls.__name__


# ---- 1. nothing evicted: bit-identical to DynamicCache ------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_keep_everything_is_bit_identical_to_dynamic_cache(model, eager_model, name):
    """With SDPA, and with eager attention for methods that take the decode probabilities (kvtrim's SDPA
    wrapper computes those steps' softmax explicitly: equal to SDPA up to rounding, see test_attention)."""
    if METHODS[name].needs_attention:
        model = eager_model
    prompt = ids(PROMPT, seed=1)
    # sized for every token it will see: nothing to evict
    method = spec_for(name).build(PROMPT + NEW, 0.0)
    want_tokens, want_scores = greedy(model, DynamicCache(config=model.config), prompt)
    cache = kvtrim.TrimCache(method, config=model.config)
    tokens, scores = greedy(model, cache, prompt)
    assert torch.equal(tokens, want_tokens) and torch.equal(scores, want_scores), method.describe()
    assert all(layer.stored == layer.seen for layer in trim_layers(cache))


# ---- 2. sizes: at_budget, the spec builder, stored lengths --------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_sizing_round_trip_and_stored_lengths(model, tok, name):
    spec = spec_for(name)
    ratio = 0.5
    budget = kept_count(PROMPT, ratio)
    method = spec.build(PROMPT, ratio)
    if not spec.is_full:
        assert method == spec.cls.at_budget(budget, PROMPT, **dict(spec.params))
    assert type(method)(**method.params()) == method  # parameters round-trip
    ctx = kvtrim.compress(model, ids(PROMPT, seed=2), method, tokenizer=tok)
    # entries per (sequence, kv_head) row on average (AdaKV: heads differ, the layer's total is bounded)
    stored = [int(layer.lengths.sum(-1).max()) / layer.lengths.shape[-1] for layer in trim_layers(ctx.cache)]
    if spec.is_full or name == "lazyeviction":  # keep the prompt (LazyEviction evicts while decoding)
        assert stored == [PROMPT] * len(stored)
    elif getattr(method, "level", None) == "head":  # KVzip: one threshold over every head and layer
        assert sum(stored) / len(stored) <= budget and min(stored) < PROMPT, (method.describe(), stored)
    else:
        assert all(s <= budget for s in stored) and min(stored) < PROMPT, (method.describe(), stored)
    assert ctx.stats().tokens_seen == PROMPT


# ---- 3. the query-agnostic protocol: context, a multi-token question, decoding --------------------------
@pytest.mark.parametrize("name", NAMES)
def test_query_agnostic_protocol(model, tok, name, monkeypatch):
    method = spec_for(name).build(PROMPT, 0.5)
    context, question = ids(PROMPT, seed=3), ids(QUESTION, seed=4)
    ctx = kvtrim.compress(model, context, method, tokenizer=tok)
    compressed = [rows(layer) for layer in trim_layers(ctx.cache)]
    assert all(layer.prompt_tokens == PROMPT for layer in trim_layers(ctx.cache))
    # the question is an append: methods that only compress the prompt keep it whole and leave the
    # compressed context alone (the question never steers what the context keeps)
    cache = ctx.new_cache()
    phases = []
    view = kvtrim.TrimLayer.view

    def recording_view(layer, *args, **kwargs):
        phases.append(view(layer, *args, **kwargs).phase)
        return view(layer, *args, **kwargs)

    monkeypatch.setattr(kvtrim.TrimLayer, "view", recording_view)
    kvtrim.prefill(model, question, cache)
    monkeypatch.undo()
    assert set(phases) == {Phase.APPEND}
    appends_evict = isinstance(method, kvtrim.ScoringMethod) and method.schedule().append
    for before, layer in zip(compressed, trim_layers(cache)):
        if not appends_evict and not (name == "lagkv" and method.mode == "reference"):
            appended = list(range(PROMPT, PROMPT + QUESTION))
            assert rows(layer) == [[row + appended for row in heads] for heads in before]
        assert layer.seen == PROMPT + QUESTION
    # generate() from the compressed context equals a hand-driven greedy loop with explicit positions
    answer = ctx.generate(question, max_new_tokens=NEW, pad_token_id=0)
    hand = ctx.new_cache()
    logits = kvtrim.prefill(model, question, hand)
    tokens = []
    with torch.no_grad():
        for step in range(NEW):
            token = logits.argmax(-1, keepdim=True)
            tokens.append(int(token))
            if step + 1 < NEW:
                pos = torch.tensor([[PROMPT + QUESTION + step]])
                logits = model(input_ids=token, cache=hand, position_ids=pos).logits[:, -1]
    assert answer[0].tolist() == tokens


# ---- 4. compress once, ask many ------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_compress_once_two_questions_equal_two_fresh_compressions(model, tok, name):
    method = spec_for(name).build(PROMPT, 0.5)
    context = ids(PROMPT, seed=5)
    q1, q2 = ids(QUESTION, seed=6), ids(QUESTION + 3, seed=7)
    ctx = kvtrim.compress(model, context, method, tokenizer=tok)
    before = ctx.stats()
    a1, a2 = ctx.generate(q1, max_new_tokens=NEW), ctx.generate(q2, max_new_tokens=NEW)
    assert ctx.stats() == before  # asking leaves the compressed context unchanged
    f1 = kvtrim.compress(model, context, method, tokenizer=tok).generate(q1, max_new_tokens=NEW)
    f2 = kvtrim.compress(model, context, method, tokenizer=tok).generate(q2, max_new_tokens=NEW)
    assert torch.equal(a1, f1) and torch.equal(a2, f2)


# ---- 5. a batch of two unpadded prompts equals each alone ----------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_batch_of_two_equals_each_alone(model, tok, name):
    method = spec_for(name).build(PROMPT, 0.5)
    both = torch.cat([ids(PROMPT, seed=8), ids(PROMPT, seed=9)])
    tokens, batch = kvtrim.generate(model, both, method, max_new_tokens=NEW, tokenizer=tok, pad_token_id=0)
    for row in range(2):
        t, alone = kvtrim.generate(model, both[row : row + 1], method, max_new_tokens=NEW, tokenizer=tok,
                                   pad_token_id=0)
        assert torch.equal(tokens[row], t[0]), method.describe()
        for lb, la in zip(trim_layers(batch), trim_layers(alone)):
            assert rows(lb)[row] == rows(la)[0]


# ---- 5b. a left-padded batch equals each alone ----------------------------------------------------------
PADDED_LENGTHS = (PROMPT, 90, 121)  # none ends with a 1-token block at block size 32 (see padded_layout)


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_equals_each_alone(model, tok, name):
    """Left padding through kvtrim.generate (stock generate; block-wise methods get each sequence's own
    blocks): each sequence's tokens and kept positions equal its run alone, pads are never stored and the
    pools stay within 2 % of the entries held. Methods that cannot (scoring passes) refuse in one line."""
    method = spec_for(name).build(PROMPT, 0.5)
    seqs = [ids(n, seed=20 + i)[0] for i, n in enumerate(PADDED_LENGTHS)]
    width = max(PADDED_LENGTHS)
    batch = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, s in enumerate(seqs):
        batch[i, width - len(s):], mask[i, width - len(s):] = s, 1
    if method.scoring_passes:
        with pytest.raises(kvtrim.KvtrimError, match="padded batch"):
            kvtrim.generate(model, batch, method, max_new_tokens=NEW, tokenizer=tok, pad_token_id=0,
                            attention_mask=mask)
        return
    tokens, cache = kvtrim.generate(model, batch, method, max_new_tokens=NEW, tokenizer=tok, pad_token_id=0,
                                    attention_mask=mask)
    for row, s in enumerate(seqs):
        t, alone = kvtrim.generate(model, s[None], method, max_new_tokens=NEW, tokenizer=tok, pad_token_id=0)
        assert torch.equal(tokens[row], t[0]), (method.describe(), row)
        for lb, la in zip(trim_layers(cache), trim_layers(alone)):
            assert rows(lb)[row] == rows(la)[0], (method.describe(), row, lb.layer_idx)
    stats = cache.stats()
    assert stats.bytes_allocated <= 1.02 * stats.bytes_ideal


# ---- 6. one-shot vs block-wise prefill ---------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_one_shot_and_block_wise_prefill(model, tok, name):
    method = spec_for(name).build(PROMPT, 0.5)
    context, chunk = ids(PROMPT, seed=10), 32
    one_shot = kvtrim.compress(model, context, method, tokenizer=tok, chunk_size=None)
    blocks = kvtrim.compress(model, context, method, tokenizer=tok, chunk_size=chunk)
    sched = method.schedule() if isinstance(method, kvtrim.ScoringMethod) else None
    for a, b in zip(trim_layers(one_shot.cache), trim_layers(blocks.cache)):
        assert b.seen == PROMPT and b.prompt_tokens == PROMPT
        if sched is not None and sched.prefill == "block":  # evicts between blocks: memory stays bounded
            assert b.peak <= method.fixed_budget() + chunk
        elif not (name == "lagkv" and method.mode == "reference"):
            # nothing evicted before the prompt ends: the same entries are kept either way
            assert rows(a) == rows(b), method.describe()
    # kvtrim.generate under stock generate's chunked prefill ends the prompt at the first decode step
    new, cache = kvtrim.generate(model, context, method, max_new_tokens=3, prefill_chunk_size=chunk, tokenizer=tok)
    ended = PROMPT - 1 if method.scoring_passes else PROMPT  # scoring methods: compress, then the last token
    assert all(layer.prompt_tokens == ended for layer in trim_layers(cache))


# ---- 6b. every layout the method supports: same tokens, same kept sets ---------------------------------
LAYOUTS = {"dense": DenseKV, "slots": SlotKV, "ragged": RaggedKV}


def layout_run(model, tok, method, prompt, layout: str):
    """Greedy decoding with every layer on `layout` (see kvtrim/storage/): dense (the copying path),
    slots (in-place decoding: the default for methods with `in_place_decode`) or ragged from the first
    forward (`padded=True`). Methods with scoring passes: compressed by `kvtrim.compress` (dense), then a
    question. Returns `(tokens, kept rows per layer, storage classes of the layers, the layers)`."""
    if method.scoring_passes:
        ctx = kvtrim.compress(model, prompt, method, tokenizer=tok)
        tokens, layers = ctx.generate(ids(QUESTION, seed=31), max_new_tokens=3 * NEW), trim_layers(ctx.cache)
        return tokens, [rows(layer) for layer in layers], [type(layer.kv) for layer in layers], layers
    cache = kvtrim.TrimCache(method, config=model.config, in_place_decode=layout == "slots",
                             padded=layout == "ragged")
    tokens, _ = greedy(model, cache, prompt, new=3 * NEW)
    layers = trim_layers(cache)
    return tokens, [rows(layer) for layer in layers], [type(layer.kv) for layer in layers], layers


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_every_layout_keeps_what_the_dense_layout_keeps(model, eager_model, tok, name, layout):
    """Each method on each storage layout it supports (`docs/storage.md`): the layers really are in that
    layout at the end, and tokens and kept positions equal the dense (copying) run. Unsupported pairs are
    skipped with the reason: slots need `in_place_decode`, ragged-from-the-start is a padded batch (no
    scoring passes, no cross-layer decisions)."""
    method = spec_for(name).build(PROMPT, 0.5)
    if layout == "slots" and not method.in_place_decode:
        pytest.skip(f"{name} does not decode in place")
    if layout == "ragged" and (method.scoring_passes or method.cross_layer):
        pytest.skip(f"{name} cannot run on a padded batch (scoring passes / cross-layer decisions)")
    if method.needs_attention:
        model = eager_model
    prompt = ids(PROMPT, seed=30)
    want_tokens, want_rows, want_kinds, _ = layout_run(model, tok, method, prompt, "dense")
    assert SlotKV not in want_kinds  # the copying path never leaves position order
    tokens, got_rows, kinds, layers = layout_run(model, tok, method, prompt, layout)
    assert torch.equal(tokens, want_tokens), (method.describe(), layout)
    assert got_rows == want_rows, (method.describe(), layout)
    if layout == "dense":  # dense unless the method keeps unequal counts per row (then ragged, for good)
        for kind, layer in zip(kinds, layers):
            assert kind is DenseKV or (kind is RaggedKV and bool((layer.lengths != layer.stored).any()))
    else:
        assert LAYOUTS[layout] in kinds, (method.describe(), kinds)
        assert layout == "slots" or set(kinds) == {RaggedKV}


# ---- 6c. `reads_values = False`: kvtrim's vLLM worker hands such a method stand-in values -----------------
def layer0_rows_per_step(model, method, tokens) -> list:
    """Layer 0's kept positions after the prompt (`PROMPT` tokens of `tokens`) and after each later token, the
    tokens fed as given (teacher forcing: the same inputs whatever the model predicts)."""
    cache = kvtrim.TrimCache(method, config=model.config)
    kvtrim.prefill(model, tokens[:, :PROMPT], cache)
    seen = [rows(trim_layers(cache)[0])]
    for i in range(PROMPT, tokens.shape[-1]):
        model(tokens[:, i:i + 1], cache=cache, use_cache=True)
        seen.append(rows(trim_layers(cache)[0]))
    return seen


def other_values(model):
    """A copy of `model` whose layer 0 has another value projection: its keys, queries and attention are the same,
    its values differ."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].self_attn.v_proj.weight.normal_(generator=torch.Generator().manual_seed(7))
    return other


@pytest.mark.parametrize("name", [n for n in NAMES if not METHODS[n].reads_values] + ["lagkv", "valuenorm"])
def test_a_method_declared_to_read_no_values_keeps_the_same_entries_whatever_they_are(model, eager_model, name):
    """Every method that declares `reads_values = False` keeps, in layer 0, the same positions at the prompt's end
    and at every decode step when only that layer's values change; LagKV and the README's ValueNorm (which read
    values) are the control: the same protocol tells them apart."""
    base = eager_model if METHODS[name].needs_attention else model
    method = spec_for(name).build(PROMPT, 0.5)
    tokens = ids(PROMPT + 3 * NEW, seed=41)
    want, got = layer0_rows_per_step(base, method, tokens), layer0_rows_per_step(other_values(base), method, tokens)
    assert (got == want) is (not METHODS[name].reads_values), method.describe()
    assert len(want[-1][0][0]) < tokens.shape[-1], method.describe()  # it evicted: the check means something


# ---- 7. bad parameters: one-line errors at construction ------------------------------------------------
def bad_values(kind: type) -> list:
    if kind is int:
        return [2.5, "3", True, None]
    if kind is float:
        return ["0.5", math.nan, math.inf, True]
    if kind is tuple:
        return ["12", 5, (1.5,)]
    if kind is bool:
        return ["yes", 1]
    return [3]


@pytest.mark.parametrize("name", NAMES)
def test_bad_parameter_types_are_one_line_errors(name):
    cls = METHODS[name]
    for f in dataclasses.fields(cls):
        kind = param_type(cls, f.name)
        for value in bad_values(kind):
            if value is None and f.default is None:
                continue  # optional parameters accept None
            with pytest.raises(kvtrim.KvtrimError) as err:
                cls(**{f.name: value})
            message = str(err.value)
            assert "\n" not in message and message, (name, f.name, value)


def test_user_method_runs_through_cli_eval_and_bench(model, tmp_path, capsys):
    from transformers import AutoTokenizer

    from kvtrim.bench.runner import BenchConfig, bench_methods, measure_cell
    from kvtrim.cli import main
    from kvtrim.eval import PromptFormat, Runner, RunSettings, generate_samples, parse_method_specs, plan
    from kvtrim.models import resolve_model_dir

    assert main(["methods"]) == 0 and "valuenorm" in capsys.readouterr().out
    spec = parse_method_spec("valuenorm:compression_ratio=0.5")
    assert isinstance(spec.build(), USER_METHOD)
    # bench
    row = measure_cell(model, bench_methods("valuenorm")[1], ids(96, seed=11),
                       BenchConfig(methods=[], compression_ratio=0.5, new_tokens=2, collect_garbage=False), 96)
    assert row["status"] == "ok" and row["stored_bytes_prefill"] == row["full_bytes_prefill"] // 2
    # eval (a tiny model whose vocabulary covers the default tokenizer)
    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    big = kvtrim.enable(tiny_model("llama", vocab=49152, layers=2))
    samples = generate_samples("passkey", PromptFormat(tok), 300, 1, seed=1, depths=(0.5,))
    rows = Runner(big, tok, RunSettings(model="tiny", max_new_tokens=3), str(tmp_path), progress=False).run(
        plan(samples, parse_method_specs("full,valuenorm"), [0.5]))
    mine = [r for r in rows if r["method"] == "valuenorm"]
    assert len(mine) == 1 and "skipped" not in mine[0] and 0.45 < mine[0]["achieved_compression"] < 0.55
