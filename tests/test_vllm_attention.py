"""The attention hand-off inside vLLM (`kvtrim.vllm.attention`): kvtrim's CPU attention backend is every
layer's impl in an engine started with kvtrim's worker, and the post-RoPE queries it copies for a prompt's
last window, across vLLM's prefill chunks, are those transformers computes for the prompt in one forward.

Run from .venv-serve (skipped without vLLM). One offline `vllm.LLM` (SmolLM2-135M, float32, eager, a token
budget of 32 per step so that prompts are cut in chunks; the last test starts a compiled one) with kvtrim's worker, its scheduler and flags; its
runner is kvtrim's with one change (tests/data/attention_probe): a request asks for its window in its
`extra_args` (`probe_window`), and reports what SnapKV requests keep after their prompt's compaction."""

import os
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")

from kvtrim.models import resolve_model_dir  # noqa: E402
from kvtrim.vllm.attention import window_rows  # noqa: E402

pytestmark = pytest.mark.integration
PROBE = os.path.join(os.path.dirname(__file__), "data", "attention_probe")
#: test methods that break the engine's contract, registered through an entry point (the engine's processes find them)
BREAKER = os.path.join(os.path.dirname(__file__), "data", "contract_breaker")
MODEL = "smollm2-135m"
BUDGET = 32  # max_num_batched_tokens: every prompt below takes several forwards

#: name -> (prompt, window asked for: 0 none); the window of "short" is longer than its prompt
REQUESTS = {
    "long": ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years "
             "presses were running in more than two hundred cities across Europe, and the price of books fell "
             "so quickly that", 40),
    "short": ("def fibonacci(n):\n    if n < 2:\n        return n\n    return", 64),
    "idle": ("Rivers carry sediment from the mountains to the sea, building deltas where the current slows and "
             "the water spreads across the plain, and", 0),
}


def test_window_rows_are_the_forwards_positions_in_the_window():
    for prompt in (1, 7, 40):
        for window in (1, 5, 40, 64):
            for computed in range(prompt):
                for scheduled in (1, 4, 50):
                    wanted = [p for p in range(computed, computed + scheduled) if prompt - window <= p < prompt]
                    got = window_rows(computed, scheduled, prompt, window)
                    assert list(range(*got)) == wanted if wanted else got is None, (computed, scheduled, prompt, window)


@pytest.fixture(scope="module")
def engine():
    yield from start_engine(eager=True)


def start_engine(eager: bool):
    """An offline engine with the probe runner (module docstring), eager or compiled (vLLM's default on the CPU:
    torch.compile of the model, attention left out of the graph as vLLM's custom op)."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from kvtrim.vllm.cli import child_env

    saved = dict(os.environ)
    # the engine's processes are spawned: they take this environment (and sys.path) with them
    os.environ.update(child_env(), VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                      PYTHONPATH=os.pathsep.join([PROBE, BREAKER, *filter(None, [os.environ.get("PYTHONPATH")])]))
    sys.path[:0] = [PROBE, BREAKER]  # (spawned processes start from this sys.path)
    model_dir = str(resolve_model_dir(MODEL))
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=eager, seed=0, max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
              worker_cls="kvtrim_attention_probe.ProbeWorker", scheduler_cls="kvtrim.vllm.scheduler.TrimScheduler",
              additional_config={"kvtrim_method": "full"})
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    try:
        yield llm, tok
    finally:
        del llm
        os.environ.clear()
        os.environ.update(saved)
        sys.path.remove(PROBE)
        sys.path.remove(BREAKER)


def generate(llm, tok, names, ask=True):
    """Greedy token ids of the named requests (sent together), each asking for its window when `ask`."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": tok(REQUESTS[n][0]).input_ids} for n in names]
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                             extra_args={"probe": n, "probe_window": REQUESTS[n][1] if ask else 0}) for n in names]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def report(llm, tmp_path):
    path = str(tmp_path / "report.pt")
    llm.collective_rpc("probe_report", args=(path,))
    return torch.load(path)


@pytest.fixture(scope="module")
def hf_queries():
    """name -> per layer, the post-RoPE queries `(q_heads, T, head_dim)` of the whole prompt in one forward
    of transformers' model (float32): its own norm, `q_proj` and rotary embedding on the layer's input."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model_dir = str(resolve_model_dir(MODEL))
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for name, (prompt, _) in REQUESTS.items():
            ids = torch.tensor([tok(prompt).input_ids])
            hidden = model(ids, output_hidden_states=True).hidden_states  # hidden[l]: layer l's input
            cos, sin = model.model.rotary_emb(hidden[0], torch.arange(ids.shape[1])[None])
            per_layer = []
            for layer, x in zip(model.model.layers, hidden):
                attn = layer.self_attn
                q = attn.q_proj(layer.input_layernorm(x)).view(1, ids.shape[1], -1, attn.head_dim).transpose(1, 2)
                per_layer.append(apply_rotary_pos_emb(q, q, cos, sin)[0][0])
            out[name] = per_layer
    return out


def test_every_layer_hands_over_its_queries(engine, tmp_path):
    llm, _ = engine
    r = report(llm, tmp_path)
    assert len(r["impls"]) == 30 and set(r["impls"].values()) == {"TrimCPUAttentionImpl"}, r["impls"]
    assert r["attention"] is True


def test_prompt_window_across_chunks_is_the_one_forward_queries(engine, hf_queries, tmp_path):
    """"long" and "short" ask for their windows, "idle" for nothing, all sent together: the windows come in
    several forwards (BUDGET tokens a step, shared by the three), and equal transformers' queries of the
    prompt's last W positions in every layer; nothing of "idle" is copied."""
    llm, tok = engine
    before = report(llm, tmp_path)
    generate(llm, tok, list(REQUESTS))
    r = report(llm, tmp_path)
    assert "idle" not in r["windows"] and "idle" not in r["plans"]
    for name in ("long", "short"):
        got = r["windows"][name]
        prompt_len = len(tok(REQUESTS[name][0]).input_ids)
        w = min(REQUESTS[name][1], prompt_len)
        assert len(r["plans"][name]) >= 2, r["plans"][name]  # the window came in more than one forward
        assert sum(b - a for a, b, _ in r["plans"][name]) == w
        assert got.shape == (30, 9, w, 64) and got.dtype == torch.float32
        ref = torch.stack([q[:, prompt_len - w:] for q in hf_queries[name]])
        for layer in range(30):
            err = (got[layer] - ref[layer]).abs().max().item()
            assert err <= 1e-4, (name, layer, err)  # measured <= 2e-5 (queries up to ~16 in magnitude)
    # one copy per layer for each (request, forward) that carried window rows
    planned = sum(len(r["plans"][n]) for n in ("long", "short"))
    assert r["copies"] - before["copies"] == 30 * planned


def test_a_request_that_asks_for_nothing_leaves_the_tap_idle(engine, tmp_path):
    """Alone, "idle" runs its prompt in several forwards and copies nothing; "long" asking or not for its
    window generates the same tokens (the copy does not touch the forward)."""
    llm, tok = engine
    before = report(llm, tmp_path)
    generate(llm, tok, ["idle"])
    after = report(llm, tmp_path)
    assert after["in_steps"]["idle"] - before["in_steps"].get("idle", 0) >= 3  # its prompt's forwards and decode steps
    assert after["copies"] == before["copies"] and "idle" not in after["plans"] and "idle" not in after["windows"]
    assert generate(llm, tok, ["long"], ask=False) == generate(llm, tok, ["long"])


#: SnapKV in the engine: a window shorter than what it keeps, so that its scores choose (max and avg pooling)
SNAPKV = ["snapkv:compression_ratio=0.5:window=8", "snapkv:compression_ratio=0.6:window=12:kernel=3:pooling=avg"]
#: SnapKV `budget=`: the prompt in one block, and in blocks of 12 (each block's last 6 queries; "long" in 5 blocks)
SNAPKV_BUDGET = ["snapkv:budget=20:window=8", "snapkv:budget=16:window=6:block_size=12:kernel=3:pooling=avg"]
SNAP_TOKENS = 8


def generate_snapkv(llm, tok, items):
    """Greedy outputs of `items` (name, prompt, spec, probe window or None: the method's) sent together."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": tok(REQUESTS[p][0]).input_ids} for _, p, _, _ in items]
    params = [SamplingParams(max_tokens=SNAP_TOKENS, temperature=0, ignore_eos=True,
                             extra_args={"probe": n, "kvtrim": spec} | ({} if w is None else {"probe_window": w}))
              for n, _, spec, w in items]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def hf_snapkv():
    """(prompt, spec) -> transformers' SnapKV on the prompt (kvtrim's attention, float32, the prompt as
    `kvtrim.prefill` feeds it: in one forward, or in the method's blocks, the last ending it): the positions kept
    after the prompt's end per layer and KV head `(layers, kv_heads, n_keep)`, and the greedy tokens."""
    from kvtrim import TrimCache, load_model
    from kvtrim.methods.base import Phase, kept_count
    from kvtrim.specs import parse_method_spec

    model, tok = load_model(MODEL, dtype="float32")  # kvtrim's attention
    out = {}
    with torch.no_grad():
        for prompt in ("long", "idle"):
            ids = torch.tensor([tok(REQUESTS[prompt][0]).input_ids])
            for spec in SNAPKV + SNAPKV_BUDGET:
                method = parse_method_spec(spec).build()
                # `kvtrim.generate`'s cache, greedy by hand (this transformers' generate takes no `cache=`)
                cache, n = TrimCache(method, config=model.config), ids.shape[-1]
                block = method.prefill_block_size() or n
                for s in range(0, n, block):  # `kvtrim.prefill` by hand (this transformers' forward takes no `cache=`)
                    with cache.phase(Phase.PREFILL, ends_prompt=s + block >= n):
                        logits = model(ids[:, s:s + block], past_key_values=cache, use_cache=True,
                                       position_ids=torch.arange(s, min(n, s + block))[None]).logits
                new = []
                for _ in range(SNAP_TOKENS):
                    new.append(int(logits[0, -1].argmax()))
                    logits = model(torch.tensor([new[-1:]]), past_key_values=cache, use_cache=True).logits
                n_keep = method.budget or kept_count(ids.shape[-1], method.compression_ratio)
                kept = torch.stack([layer.kept_positions()[0].sort(dim=-1).values[:, :n_keep]
                                    for layer in cache.layers])
                assert kept.shape[-1] == n_keep < ids.shape[-1] and int(kept.max()) < ids.shape[-1]
                out[prompt, spec] = kept, new
    return out


@pytest.mark.parametrize("specs", [SNAPKV, SNAPKV_BUDGET], ids=["ratio", "budget"])
def test_snapkv_keeps_what_transformers_keeps(engine, hf_snapkv, tmp_path, specs):
    """SnapKV in the engine: the prompt's last `window` queries (each block's, for `block_size=`), captured
    across vLLM's chunks (BUDGET tokens a step: "long" alone in 3 forwards, then with others in different cuts),
    reach the method at the prompt's (block's) end; the positions its blocks keep, per layer and KV head, are
    those `TrimCache` keeps in transformers (`kvtrim.prefill`), and the greedy tokens are transformers'."""
    llm, tok = engine
    a, b = specs
    runs = [[("alone", "long", a, None)],
            [("with-long", "long", a, None), ("with-idle", "idle", b, None), ("with-full", "short", "full", None)],
            [("idle-a", "idle", a, None), ("long-b", "long", b, None)]]
    for items in runs:
        outputs = generate_snapkv(llm, tok, items)
        r = report(llm, tmp_path)
        for (name, prompt, spec, _), output in zip(items, outputs):
            assert len(output.token_ids) == SNAP_TOKENS and name not in r["failed"]
            if spec == "full":
                continue
            kept, tokens = hf_snapkv[prompt, spec]
            assert r["kept"][name].shape == kept.shape == (30, 3, kept.shape[-1]), name
            differ = (r["kept"][name] != kept).any(dim=-1)
            assert not differ.any(), (name, differ.nonzero().tolist())
            assert list(output.token_ids) == tokens, name
            if "block_size" not in spec:  # (a block that evicts nothing leaves its window to the next block's start)
                assert name not in r["windows"]  # the window went with the compaction
    assert len(r["plans"]["with-long"]) >= 1 and len(r["plans"]["alone"]) >= 1


def test_snapkv_without_its_queries_fails_alone(engine, tmp_path):
    """A SnapKV request whose queries are not captured (what a runner without the hand-off does: its window is
    0) ends with an error at its prompt's end, in one line; the request sent with it answers in full."""
    llm, tok = engine
    outputs = generate_snapkv(llm, tok, [("no-queries", "long", SNAPKV[0], 0), ("beside", "idle", SNAPKV[1], None)])
    r = report(llm, tmp_path)
    assert "needs the prompt's queries" in r["failed"]["no-queries"] and "\n" not in r["failed"]["no-queries"]
    assert outputs[0].finish_reason != "length" and len(outputs[0].token_ids) < SNAP_TOKENS
    assert len(outputs[1].token_ids) == SNAP_TOKENS and "beside" not in r["failed"] and "beside" in r["kept"]


#: TOVA and H2O in the engine: a budget below the prompt (the prompt's end cuts, then every decode step evicts
#: one), and a ratio (the budget fixed when the prompt ends)
TOVA = ["tova:budget=24", "tova:compression_ratio=0.5"]
H2O = ["h2o:budget=24", "h2o:compression_ratio=0.5"]
#: LazyEviction: evicting every 3 (2) decode steps, the prompt counted in its budget
LAZY = ["lazyeviction:budget=24:window=3", "lazyeviction:budget=20:window=2:alpha=0.01:gqa=mean"]
TOVA_TOKENS = 8  # the last sampled token is never forwarded: TOVA_TOKENS - 1 decode steps


@pytest.fixture(scope="module")
def hf_tova():
    """(prompt, spec) -> transformers' TOVA, H2O and LazyEviction (kvtrim's attention, float32, the prompt in one forward, then one
    token a step, greedy): the positions kept after the prompt and `TOVA_TOKENS - 1` decode steps per layer and
    KV head `(layers, kv_heads, n_keep)` sorted, and the greedy tokens."""
    from kvtrim import TrimCache, load_model
    from kvtrim.specs import parse_method_spec

    model, tok = load_model(MODEL, dtype="float32")  # kvtrim's attention
    out = {}
    with torch.no_grad():
        for prompt in ("long", "idle"):
            ids = torch.tensor([tok(REQUESTS[prompt][0]).input_ids])
            for spec in TOVA + H2O + LAZY:
                cache = TrimCache(parse_method_spec(spec).build(), config=model.config, prompt_length=ids.shape[-1])
                logits, new = model(ids, past_key_values=cache, use_cache=True).logits, []
                for step in range(TOVA_TOKENS):
                    new.append(int(logits[0, -1].argmax()))
                    if step < TOVA_TOKENS - 1:
                        logits = model(torch.tensor([new[-1:]]), past_key_values=cache, use_cache=True).logits
                kept = torch.stack([layer.kept_positions()[0].sort(dim=-1).values for layer in cache.layers])
                assert int(kept.max()) == ids.shape[-1] + TOVA_TOKENS - 2 and kept.shape[-1] < ids.shape[-1]
                out[prompt, spec] = kept, new
    return out


@pytest.mark.parametrize("specs", [TOVA, H2O, LAZY], ids=["tova", "h2o", "lazy"])
def test_decode_attention_keeps_what_transformers_keeps(engine, hf_tova, tmp_path, specs):
    """TOVA, H2O and LazyEviction in the engine: the prompt's last queries (TOVA: the last, captured in its last
    chunk; H2O: its prompt's attention column sums instead, added up after each prefill chunk: no prompt query is
    held across chunks; LazyEviction: none) at the prompt's end, then at each decode step the step's
    query, whose probabilities over the request's stored entries kvtrim's attention backend computes for all such
    requests of the step, right after the layer's attention (or with it, from kvtrim's kernel, when the step's forward
    is such requests' decode steps alone: the request alone here), and which the compaction takes (H2O: accumulated in its
    state across compactions; LazyEviction: its recurrence state, carried the same way):
    after the last decode step, the positions its blocks hold, per layer and KV head, are those `TrimCache` keeps
    in transformers, and the greedy tokens are transformers'; a request beside it with another method, or none,
    is unaffected."""
    a, b = specs
    m = a.split(":")[0]
    runs = [[(f"{m}-alone", "long", a, None)],
            [(f"{m}-long", "long", b, None), (f"{m}-idle", "idle", a, None), (f"{m}-full", "short", "full", None)],
            [(f"{m}-idle-b", "idle", b, None), (f"{m}-snap", "long", SNAPKV[0], None)]]
    check_decode_runs(engine, hf_tova, tmp_path, runs, specs)


def check_decode_runs(engine, hf_tova, tmp_path, runs, specs):
    """Send each run's requests `(name, prompt, spec, _)` together; those whose spec is in `specs` must keep, after
    their last decode step, the positions transformers keeps (`hf_tova`) and give its greedy tokens."""
    llm, tok = engine
    for items in runs:
        from vllm import SamplingParams

        before = report(llm, tmp_path)
        taken, attended = before["probs_taken"], before["attended"]

        prompts = [{"prompt_token_ids": tok(REQUESTS[p][0]).input_ids} for _, p, _, _ in items]
        params = [SamplingParams(max_tokens=TOVA_TOKENS, temperature=0, ignore_eos=True,
                                 extra_args={"probe": n, "kvtrim": spec}) for n, _, spec, _ in items]
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        r = report(llm, tmp_path)
        # every decode step's probabilities came from kvtrim's attention backend
        fed = sum(spec.split(":")[0] in ("tova", "h2o", "lazyeviction") for _, _, spec, _ in items)
        assert r["probs_taken"] - taken == fed * (TOVA_TOKENS - 1)
        if len(items) == fed == 1:  # its decode steps alone in their forwards: their attention from kvtrim's kernel,
            # with the probabilities (`QueryTap.attends`), in every layer
            assert r["attended"] - attended == 30 * (TOVA_TOKENS - 1), r["attended"] - attended
        for (name, prompt, spec, _), output in zip(items, outputs):
            assert len(output.token_ids) == TOVA_TOKENS and name not in r["failed"], (name, r["failed"].get(name))
            if spec not in specs:
                continue
            kept, tokens = hf_tova[prompt, spec]
            end, got = r["latest"][name]
            assert end == len(tok(REQUESTS[prompt][0]).input_ids) + TOVA_TOKENS - 1, name
            assert got.shape == kept.shape == (30, 3, kept.shape[-1]), name
            differ = (got != kept).any(dim=-1)
            assert not differ.any(), (name, differ.nonzero().tolist())
            assert list(output.token_ids) == tokens, name
            if spec.startswith("h2o"):  # its prompt's sums, chunk by chunk (positions 0.. in order), then dropped
                n, chunks = len(tok(REQUESTS[prompt][0]).input_ids), r["sum_chunks"][name]
                assert [c for c, _ in chunks] == [sum(r for _, r in chunks[:i]) for i in range(len(chunks))], chunks
                assert sum(r for _, r in chunks) == n and max(r for _, r in chunks) <= BUDGET, chunks
                assert name not in r["sums_held"] and name not in r["windows"]
    assert not r["sums_held"]


@pytest.fixture(scope="module")
def compiled_engine():
    yield from start_engine(eager=False)


def test_decode_attention_under_compiled_mode(compiled_engine, hf_tova, tmp_path):
    """The hand-off in a compiled engine (vLLM's default; the other tests run eager): TOVA, H2O and LazyEviction
    requests sent together keep what transformers keeps and give its tokens, SnapKV's beside them too."""
    runs = [[("c-tova", "long", TOVA[0], None), ("c-h2o", "idle", H2O[1], None), ("c-lazy", "long", LAZY[1], None),
             ("c-snap", "idle", SNAPKV[0], None)]]
    check_decode_runs(compiled_engine, hf_tova, tmp_path, runs, [TOVA[0], H2O[1], LAZY[1]])


def test_a_method_raising_or_a_plan_disagreeing_on_the_worker_fails_only_that_request(engine, hf_tova, tmp_path):
    """Worker-side failures end only the request at fault, with its one-line reason as its output's `stop_reason`
    (vLLM's `RequestOutput`): a user method whose `on_attention` raises at decode steps (two such requests, decided
    alone, then as a batch of their own), one whose `prompt_queries` raises in the worker as its prompt forward is
    planned (it stopped the engine before), and a TOVA request whose plan disagrees with what the worker keeps at a
    decode step where it would be decided in one batch with two other TOVA requests (`probe_tamper`: it is decided
    alone, and fails alone). The requests beside them answer transformers' tokens."""
    from vllm import SamplingParams

    llm, tok = engine
    runs = [[("ok-a", "long", TOVA[0], None), ("tampered", "long", TOVA[0], 1), ("ok-b", "long", TOVA[0], None)],
            [("attn-a", "idle", "raises_in_on_attention:budget=24", None),
             ("attn-b", "idle", "raises_in_on_attention:budget=24", None), ("ok-idle", "idle", TOVA[1], None),
             ("queries", "long", "raises_in_worker_prompt_queries:compression_ratio=0.5", None)]]
    outputs = {}
    for run in runs:  # (the engine runs 4 requests at once)
        prompts = [{"prompt_token_ids": tok(REQUESTS[p][0]).input_ids} for _, p, _, _ in run]
        params = [SamplingParams(max_tokens=TOVA_TOKENS, temperature=0, ignore_eos=True,
                                 extra_args={"probe": n, "kvtrim": spec} | ({"probe_tamper": t} if t else {}))
                  for n, _, spec, t in run]
        outputs |= {n: o.outputs[0] for (n, *_), o in zip(run, llm.generate(prompts, params, use_tqdm=False))}
    r = report(llm, tmp_path)
    for name in ("tampered", "attn-a", "attn-b", "queries"):
        out = outputs[name]
        assert out.finish_reason == "error" and out.stop_reason == f"kvtrim: {r['failed'][name]}", (name, out)
        assert "\n" not in r["failed"][name]
    assert "the scheduler expected" in r["failed"]["tampered"], r["failed"]["tampered"]
    assert "on_attention failed on purpose" in r["failed"]["attn-a"]
    assert "prompt_queries failed on purpose" in r["failed"]["queries"]
    for name, prompt, spec, _ in runs[0] + runs[1]:
        if name.startswith("ok"):
            kept, tokens = hf_tova[prompt, spec]
            assert name not in r["failed"] and list(outputs[name].token_ids) == tokens, name
            end, got = r["latest"][name]  # (the probe sees the steps decided alone: the last one if it was)
            assert end < len(tok(REQUESTS[prompt][0]).input_ids) + TOVA_TOKENS - 1 or torch.equal(got, kept), name
