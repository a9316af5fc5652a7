"""`TrimScheduler`'s block accounting, on vLLM's real scheduler and KV-cache manager, without a model.

Steps are driven by hand: `schedule()`, then `update_from_output()` with one sampled token per request whose
prompt is done (what the worker would return). The kept counts are checked against a `TrimCache` run on
random keys of the same length (the method as `model.generate` runs it). Run from .venv-serve."""

import re

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvtrim.cache import TrimCache  # noqa: E402
from kvtrim.methods.base import Phase  # noqa: E402
from kvtrim.models import resolve_model_dir  # noqa: E402
from kvtrim.specs import parse_method_spec  # noqa: E402
from kvtrim.vllm.kv_spec import trim_spec  # noqa: E402
from kvtrim.vllm.manager import TrimAttentionManager  # noqa: E402
from kvtrim.vllm.planning import PLAN_ATTR, Step, block_end  # noqa: E402
from kvtrim.vllm.scheduler import TrimScheduler  # noqa: E402

BLOCK = 16


@pytest.fixture(autouse=True, scope="module")
def _keep_environment():
    """Building a `VllmConfig` on the CPU sets LD_PRELOAD and LOCAL_WORLD_SIZE in this process: undo it for
    the tests that start servers after these."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
METHODS = ["streaming:compression_ratio=0.75", "lagkv:compression_ratio=0.75:lag_size=32",
           "keydiff:compression_ratio=0.5", "knorm:compression_ratio=0.6"]


def make_config(method: str = "full", max_seqs: int = 32, cache: dict | None = None, admission=None,
                batched: int = 8192) -> VllmConfig:
    model = ModelConfig(model=str(resolve_model_dir("smollm2-135m")), dtype="float32", max_model_len=2048)
    return VllmConfig(model_config=model,
                      cache_config=CacheConfig(**{"block_size": BLOCK, "enable_prefix_caching": False, **(cache or {})}),
                      scheduler_config=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=batched,
                                                       max_model_len=2048, is_encoder_decoder=False,
                                                       enable_chunked_prefill=True),
                      additional_config={"kvtrim_method": method,
                                         **({"kvtrim_admission": admission} if admission is not None else {})})


def make_scheduler(blocks: int, method: str = "full", max_seqs: int = 32, admission=None,
                   batched: int = 8192, prefix_caching: bool = False) -> TrimScheduler:
    cfg = make_config(method, max_seqs, admission=admission, batched=batched,
                      cache={"enable_prefix_caching": prefix_caching})
    cfg.cache_config.num_gpu_blocks = blocks + 1  # vLLM keeps one null block
    spec = trim_spec(FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32))
    kv = KVCacheConfig(num_blocks=blocks + 1, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return TrimScheduler(cfg, kv, StructuredOutputManager(cfg), block_size=BLOCK)


def add(s: TrimScheduler, n: int, prompt: int, new_tokens: int, spec: str | None = None, start: int = 0):
    for i in range(start, start + n):
        extra = {"kvtrim": spec} if spec else None
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, extra_args=extra)
        s.add_request(Request(f"r{i}", list(range(100 + i, 100 + i + prompt)), params, None))


def step(s: TrimScheduler, plans: bool = False):
    """One engine step with a fake model: a token for every request whose scheduled tokens reach its end.
    Returns the tokens scheduled per request (and with `plans`, the compactions planned for the worker)."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                sampled_token_ids=sampled))
    return (out.num_scheduled_tokens, getattr(out, PLAN_ATTR).due) if plans else out.num_scheduled_tokens


def free_blocks(s: TrimScheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def held(s: TrimScheduler, req_id: str) -> int:
    return len(s.kv_cache_manager.get_block_ids(req_id)[0])


def reference_kept(spec: str, n: int) -> int:
    """Entries kept of an `n`-token prompt, by `TrimCache` on random keys (30 layers, 3 KV heads, as SmolLM2)."""
    cache = TrimCache(parse_method_spec(spec).build())
    with cache.phase(Phase.PREFILL, ends_prompt=True):
        for layer in range(30):
            k, v = torch.randn(2, 1, 3, n, 64)
            cache.update(k, v, layer)
    counts = {layer.kept_positions()[0].shape[-1] for layer in cache.trim_layers()}
    assert len(counts) == 1
    return counts.pop()


def run_all(s: TrimScheduler, limit: int = 2000) -> int:
    """Steps until every request is done; returns the most requests scheduled in one step."""
    most = 0
    for _ in range(limit):
        if not s.has_requests():
            return most
        most = max(most, len(step(s)))
    raise AssertionError("requests did not finish")


def test_the_registered_manager_owns_the_blocks():
    """vLLM's own coordinator builds kvtrim's manager for `TrimAttentionSpec` (through `KVCacheSpecRegistry`), and
    vLLM's `KVCacheManager` is left as it is."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    s = make_scheduler(40)
    assert type(s.kv_cache_manager) is KVCacheManager
    (manager,) = s.kv_cache_manager.coordinator.single_type_managers
    assert type(manager) is TrimAttentionManager and manager is s.trim and free_blocks(s) == 40


def test_the_scheduler_refuses_a_worker_without_kvtrims_spec():
    from kvtrim.methods.base import KvtrimError

    cfg = make_config()
    cfg.cache_config.num_gpu_blocks = 13
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=13, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    with pytest.raises(KvtrimError, match="needs kvtrim's worker"):
        TrimScheduler(cfg, kv, StructuredOutputManager(cfg), block_size=BLOCK)


@pytest.mark.parametrize("spec", METHODS)
def test_blocks_freed_are_what_the_kept_count_leaves(spec):
    prompt = 200
    s = make_scheduler(200)
    add(s, 3, prompt, 8, spec)
    out = s.schedule()  # the three prompts in one forward, then compaction
    kept = reference_kept(spec, prompt)
    assert kept < prompt
    # the plan the worker gets with the step: compact all three to the count the blocks are freed by
    plan = getattr(out, PLAN_ATTR)
    assert sorted(plan.due) == ["r0", "r1", "r2"] and plan.seconds >= 0
    assert {(d.end, d.discarded, d.steps[0].ends_prompt) for d in plan.due.values()} == {(prompt, prompt - kept, True)}
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                sampled_token_ids=[[7]] * 3))
    need = -(-kept // BLOCK)
    for i in range(3):
        assert held(s, f"r{i}") == need, (spec, kept)
    assert free_blocks(s) == 200 - 3 * need
    assert s.kvtrim_freed_blocks == 3 * (-(-prompt // BLOCK) - need)
    # decoding allocates by what is stored: a new block only when the kept entries fill theirs
    for t in range(1, 7):  # request finishes at its 8th token
        assert not step(s, plans=True)[1]  # a prompt-end method plans nothing while decoding
        assert held(s, "r0") == -(-(kept + t) // BLOCK)
    run_all(s)
    assert free_blocks(s) == 200 and not s.trim.states


def reference_stored(spec: str, prompt: int, new: int) -> list[int]:
    """Entries stored after each of `prompt + new` tokens fed as `kvtrim.generate` feeds them (the prompt in one
    forward, or in the method's prefill blocks, then one token at a time), by `TrimCache` on random keys (one
    layer, 3 KV heads): `[tokens] -> stored` (inside a prompt block: the tokens stored so far, nothing evicted)."""
    method = parse_method_spec(spec).build()
    cache, block = TrimCache(method), method.prefill_block_size() or prompt
    stored = [0] * (prompt + new + 1)
    for start in range(0, prompt, block):
        q = min(block, prompt - start)
        before = cache.layers[0].stored if cache.layers else 0
        stored[start + 1:start + q] = range(before + 1, before + q)
        with cache.phase(Phase.PREFILL, ends_prompt=start + q == prompt):
            cache.update(*torch.randn(2, 1, 3, q, 64), 0)
        stored[start + q] = cache.layers[0].stored
    for t in range(prompt + 1, prompt + new + 1):
        cache.update(*torch.randn(2, 1, 3, 1, 64), 0)
        stored[t] = cache.layers[0].stored
    return stored


@pytest.mark.parametrize("spec", ["keydiff:budget=64:block_size=32", "lagkv:lag_size=32:sink_size=4",
                                  "streaming:budget=40"])
def test_decoding_evictions_return_blocks(spec):
    """Methods that evict while decoding: after every step each request holds the blocks of what it stores (plus
    the next token's slot after a decode step that evicted: `slots_held`), and blocks go back to the pool during
    decoding too."""
    prompt, new = 200, 120
    s = make_scheduler(200)
    add(s, 2, prompt, new, spec)
    expected = reference_stored(spec, prompt, new)
    freed_at_prompt = None
    while "r0" in s.requests:
        step(s)
        if "r0" in s.requests and s.requests["r0"].num_computed_tokens >= prompt and freed_at_prompt is None:
            freed_at_prompt = s.kvtrim_freed_blocks
        for r in s.running:
            n = r.num_computed_tokens
            spare = n > prompt and expected[n] <= expected[n - 1]  # this step's decode evicted
            assert held(s, r.request_id) == -(-(expected[n] + spare) // BLOCK), (spec, n)
    blocks = [-(-n // BLOCK) for n in expected[prompt:]]
    shrinks = any(b < a for a, b in zip(blocks, blocks[1:]))  # a decode step leaves fewer blocks than the one before
    assert shrinks == (spec != "streaming:budget=40")  # streaming's 40 entries never leave their 3 blocks
    assert (s.kvtrim_freed_blocks > freed_at_prompt) == shrinks  # decode-time compactions returned blocks too
    run_all(s)
    assert free_blocks(s) == 200 and not s.trim.states


def test_full_frees_nothing_and_a_request_picks_its_method():
    s = make_scheduler(100, method="streaming:compression_ratio=0.75")
    add(s, 1, 160, 4, "full")
    add(s, 1, 160, 4, None, start=1)  # the server's default
    step(s)
    assert held(s, "r0") == 10 and held(s, "r1") == 3
    run_all(s)
    assert free_blocks(s) == 100


@pytest.mark.parametrize("spec", ["streaming:compression_ratio=0.75", "keydiff:compression_ratio=0.75"])
def test_compaction_runs_more_requests_at_once(spec):
    """A 40-block pool, 12 requests of 160 + 16 tokens: full holds 4 at once (10-11 blocks each)."""
    full, evicted = make_scheduler(40), make_scheduler(40)
    add(full, 12, 160, 16)
    add(evicted, 12, 160, 16, spec)
    most_full, most_evicted = run_all(full), run_all(evicted)
    assert most_full == 4
    assert most_evicted >= 2 * most_full, (most_full, most_evicted)
    assert free_blocks(full) == free_blocks(evicted) == 40


@pytest.mark.parametrize("spec", ["streaming:compression_ratio=0.75", "lagkv:lag_size=16:sink_size=4"])
def test_preempted_request_is_compacted_again_and_nothing_leaks(spec):
    """A full-cache request (reserved nothing: admitted as vLLM admits) outgrows a 12-block pool: vLLM
    preempts the compacted request admitted after it, which is recomputed from its tokens (prompt +
    generated) and compacted again; its old count goes with its blocks."""
    s = make_scheduler(12)
    add(s, 1, 64, 80, "full")  # 4 blocks, growing to 9
    add(s, 2, 64, 80, spec, start=1)  # 64 -> 16 kept (1 block); 80 new tokens grow each to 6 blocks
    preempted = 0
    for _ in range(2000):
        if not s.has_requests():
            break
        step(s)
        preempted = max([preempted] + [r.num_preemptions for r in s.requests.values() if r.request_id != "r0"])
        for r in s.running:  # what each holds is what it stores (token count minus what it discarded)
            gone = s.trim.states[r.request_id].discarded
            assert held(s, r.request_id) == -(-(r.num_computed_tokens - gone) // BLOCK)
    assert not s.has_requests() and preempted > 0
    assert free_blocks(s) == 12 and not s.trim.states


@pytest.mark.parametrize("spec", ["keydiff:budget=32:block_size=16", "streaming:budget=40",
                                  "lagkv:lag_size=8:keep_ratio=0.25:sink_size=4"])
def test_admission_by_peak_never_preempts(spec):
    """Requests are admitted by their method's peak (`peak_stored`), not by their prompt: short prompts that
    would all fit at first are admitted only as many as the pool holds at their peaks, and none is ever
    preempted (vLLM alone would admit six 2-block prompts, then preempt as they grow)."""
    method = parse_method_spec(spec).build()
    peak = -(-method.peak_stored(20, 220) // BLOCK)
    assert 3 <= peak <= 6
    s = make_scheduler(12)
    add(s, 8, 20, 200, spec)
    most = 0
    for _ in range(5000):
        if not s.has_requests():
            break
        most = max(most, len(step(s)))
        assert all(r.num_preemptions == 0 for r in s.requests.values())
        assert sum(held(s, r.request_id) for r in s.running) <= 12
    assert not s.has_requests() and most == 12 // peak
    assert free_blocks(s) == 12 and not s.trim.states


def test_admission_as_vllm_admits_eagerly_and_preempts():
    """`kvtrim serve --admission vllm`: the same load as above is admitted by its prompts (six at first) and
    preempted as it grows; blocks still follow the stored counts and nothing leaks."""
    s = make_scheduler(12, admission="vllm")
    add(s, 8, 20, 200, "streaming:budget=32")
    most, preempted = 0, 0
    for _ in range(5000):
        if not s.has_requests():
            break
        most = max(most, len(step(s)))
        preempted = max([preempted] + [r.num_preemptions for r in s.requests.values()])
    assert not s.has_requests() and most == 6 and preempted > 0
    assert free_blocks(s) == 12 and not s.trim.states


@pytest.mark.parametrize("batched", [8192, 20])
def test_a_prompt_longer_than_the_pool_is_read_in_blocks(batched):
    """KeyDiff `budget=48:block_size=32` (peak 80 entries, 5 blocks) reads a 700-token prompt on a 12-block
    (192-token) pool: no forward crosses a block's end, whatever vLLM's token budget cuts (`batched`), the
    request never holds more than its peak, its blocks follow its stored counts, and two such requests run side
    by side (12 // 5) without preemption."""
    spec = "keydiff:budget=48:block_size=32"
    s = make_scheduler(12, max_seqs=4, batched=batched)
    add(s, 3, 700, 40, spec)
    most, chunks, prompt_compactions = 0, [], 0
    for _ in range(5000):
        if not s.has_requests():
            break
        computed = {r: s.requests[r].num_computed_tokens for r in s.requests}
        scheduled, due = step(s, plans=True)
        most = max(most, len(scheduled))
        for r, n in scheduled.items():
            start = computed[r]
            if start < 700:
                chunks.append(n)
                assert start + n <= block_end(start, 700, 32), (start, n)
                if r in due:  # compacted only after a block (when it evicts), never inside one
                    assert (start + n) % 32 == 0 or start + n == 700
                    prompt_compactions += 1
        for r in s.running:
            gone = s.trim.states[r.request_id].discarded
            spare = r.request_id in due and r.num_computed_tokens > 700  # a decode step evicted: the next slot stays
            assert held(s, r.request_id) == -(-(r.num_computed_tokens - gone + spare) // BLOCK) <= 5
        assert all(r.num_preemptions == 0 for r in s.requests.values())
    assert not s.has_requests() and most == 2 and max(chunks) == min(32, batched)
    assert prompt_compactions == 3 * (-(-700 // 32) - 1)  # every block from the second on evicts
    assert free_blocks(s) == 12 and not s.trim.states


def test_a_request_the_pool_can_never_hold_ends_with_an_error():
    """On a 12-block pool a `full` request of 700 prompt tokens (44 blocks) could only be admitted to be
    preempted again and again: it ends with an error (one line in the log, its reason as the output's
    `stop_reason`) in the first step, without holding up the requests queued behind it (vLLM's admission loop
    stops at the first waiting request it cannot admit: the failed one is gone before it runs)."""
    s = make_scheduler(12)
    add(s, 1, 700, 10, "full")
    add(s, 2, 40, 10, "keydiff:budget=48:block_size=32", start=1)
    why = s.trim.failed["r0"]  # (worked out when it was added)
    assert why.startswith("its prompt of 700 tokens and max_tokens=10 may take 45 KV blocks under full, more than "
                          "the 12 of this server's pool") and "\n" not in why
    assert set(s.trim.failed) == {"r0"}
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"r1", "r2"} and "r0" not in s.requests
    ids = list(out.num_scheduled_tokens)
    outputs = s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                          sampled_token_ids=[[7] for _ in ids]))
    ended = [o for client in outputs.values() for o in client.outputs if o.request_id == "r0" and o.finish_reason]
    assert len(ended) == 1 and ended[0].finish_reason.name == "ERROR" and ended[0].stop_reason == f"kvtrim: {why}"
    run_all(s)
    assert s.kvtrim_failed_requests == 1 and free_blocks(s) == 12 and not s.requests


@pytest.mark.parametrize("spec,prompt,new_tokens,unfit", [
    ("full", 700, 10, True), ("full", 150, 10, False), ("full", 150, 60, True), ("full", 100, None, True),
    ("keydiff:budget=48:block_size=32", 1500, 400, False), ("streaming:budget=64", 100, 1500, False),
    ("snapkv:compression_ratio=0.5", 300, 10, False), ("snapkv:compression_ratio=0.5", 400, 10, True),
    ("lagkv:compression_ratio=0.5", 180, 4, False), (None, 120, 100, False), (None, 120, 200, True)])
def test_the_front_end_refuses_exactly_what_the_manager_would_end(spec, prompt, new_tokens, unfit):
    """The server's front end (`TrimCpuPlatform.validate_request`, an HTTP 400) refuses a request exactly when
    the scheduler's manager would end it before it runs (the same rule, `never_fits`, fed from the server's
    configuration instead of the manager's own state), with the same line; `spec=None`: the server's default
    (`snapkv:compression_ratio=0.5`); `new_tokens=None`: vLLM's default, up to `max_model_len`."""
    from kvtrim.vllm.platform import unfit_request

    s = make_scheduler(12, method="snapkv:compression_ratio=0.5")  # 12 blocks of 16: 192 entries
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, extra_args={"kvtrim": spec} if spec else None)
    why = unfit_request(s.vllm_config, prompt, params)
    if new_tokens is None:  # vLLM's front end resolves it as it builds the request
        params.max_tokens = s.vllm_config.model_config.max_model_len - prompt
    s.add_request(Request("r0", list(range(100, 100 + prompt)), params, None))
    assert why == s.trim.failed.get("r0"), (why, s.trim.failed)
    assert (why is not None) == unfit and (why is None or why.startswith(f"its prompt of {prompt} tokens"))


def test_with_prefix_caching_requests_share_blocks_and_compactions_write_only_their_own():
    """vLLM's prefix caching on, a prompt cached by a `full` request: `full` and prompt-end compacting requests
    (KeyDiff, StreamingLLM) of the same prompt start from its cached blocks; H2O (it needs every prompt row's
    attention) computes the whole prompt. A compaction never writes a block another request holds or the cache
    indexes: the blocks it writes are fresh copies (`Due.copies`, from the old shared ones), the old ones go back
    after it, and the prompt stays cached (a later `full` request still finds it). The counts are those of a
    request that computed its whole prompt; the pool ends with every block free."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    s = make_scheduler(40, prefix_caching=True)
    prompt = list(range(100, 100 + 150))  # 9 full blocks and a part

    def send(rid, spec):
        extra = {"kvtrim": spec} if spec else None
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=40, ignore_eos=True, extra_args=extra), None,
                              block_hasher=hasher))

    send("f0", None)
    step(s)  # f0's prompt: its 9 full blocks cached
    cached = list(s.trim.req_to_blocks["f0"][:9])
    for rid, spec in [("f1", None), ("k0", "keydiff:compression_ratio=0.5"), ("s0", "streaming:budget=64"),
                      ("h0", "h2o:compression_ratio=0.5")]:
        send(rid, spec)
    scheduled, due = step(s, plans=True)
    assert scheduled == {"f0": 1, "f1": 6, "k0": 6, "s0": 6, "h0": 150}  # hits of 144 tokens, but for H2O
    assert due["k0"].discarded == 75 and due["s0"].discarded == 150 - 64 and due["h0"].discarded == 75
    for rid, keep in [("k0", 5), ("s0", 4)]:  # blocks of 16 holding the 75 and 64 kept entries
        copies = due[rid].copies
        assert [i for i, _, _ in copies] == list(range(keep))  # each one written was a cached, shared block ...
        assert [old for _, old, _ in copies] == [b.block_id for b in cached[:keep]]
        mine = s.trim.req_to_blocks[rid]
        assert all(b.block_hash is None and b.ref_cnt == 1 for b in mine)  # ... and is now its own
    assert not due["h0"].copies and all(b.block_hash is None for b in s.trim.req_to_blocks["h0"])
    assert [b.ref_cnt for b in cached] == [2] * 9  # f0 and f1 hold them; the copies' old blocks were let go
    run_all(s)
    send("f9", None)
    assert step(s) == {"f9": 6}  # still cached
    run_all(s)
    assert free_blocks(s) == 40 and not s.trim.states


def test_a_context_is_the_methods_prompt_and_no_forward_crosses_it():
    """`kvtrim_context=100` on a 150-token prompt under KeyDiff at 0.5, forwards of at most 64 tokens: no forward
    crosses token 100; the compaction after the one that ends there tells the method a prompt of 100 tokens (it
    keeps 50); the 50 tokens after it are read as an append (no compaction), then decoded; the request holds the
    blocks of what it stores."""
    s = make_scheduler(40, batched=64)
    params = SamplingParams(max_tokens=5, ignore_eos=True,
                            extra_args={"kvtrim": "keydiff:compression_ratio=0.5", "kvtrim_context": 100})
    s.add_request(Request("r0", list(range(100, 250)), params, None))
    ends, plans = [], []
    while "r0" in s.requests:
        computed = s.requests["r0"].num_computed_tokens
        scheduled, due = step(s, plans=True)
        ends.append(computed + scheduled["r0"])
        plans += [due["r0"]] if "r0" in due else []
        stored = ends[-1] - (50 if ends[-1] >= 100 else 0)
        assert "r0" not in s.requests or held(s, "r0") == -(-stored // BLOCK)
    assert ends == [64, 100, 150, 151, 152, 153, 154]
    assert len(plans) == 1 and plans[0].steps == [Step(Phase.PREFILL, True, 100)] and plans[0].discarded == 50
    assert free_blocks(s) == 40


def test_a_context_request_shares_the_cache_only_inside_its_context():
    """Prefix caching on, a 150-token prompt cached by a `full` request: a request naming `kvtrim_context=100`
    (KeyDiff at 0.5) finds the cached blocks inside its context only (96 tokens: 6 blocks of 16), computes the
    rest of the context, is compacted at its end as a request that computed it all (a prompt of 100, 50 kept),
    writing fresh copies of the shared blocks."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    s = make_scheduler(40, prefix_caching=True)
    prompt = list(range(100, 250))
    s.add_request(Request("f0", prompt, SamplingParams(max_tokens=5, ignore_eos=True), None, block_hasher=hasher))
    step(s)
    params = SamplingParams(max_tokens=5, ignore_eos=True,
                            extra_args={"kvtrim": "keydiff:compression_ratio=0.5", "kvtrim_context": 100})
    s.add_request(Request("c0", prompt, params, None, block_hasher=hasher))
    scheduled, due = step(s, plans=True)
    assert scheduled["c0"] == 100 - 96
    assert due["c0"].steps == [Step(Phase.PREFILL, True, 100)] and due["c0"].discarded == 50
    assert [i for i, _, _ in due["c0"].copies] == [0, 1, 2, 3]  # the blocks of the 50 kept: cached, shared
    (context,) = s.trim.contexts.contexts.values()  # (its full blocks are shared from now on: compressed)
    assert all(b.block_hash is None and b.ref_cnt == 1 + (b in context.blocks) for b in s.trim.req_to_blocks["c0"])
    run_all(s)
    assert free_blocks(s) == 40 - len(context.held())


@pytest.mark.parametrize("xargs, why", [
    ({"kvtrim": "keydiff:compression_ratio=0.5", "kvtrim_context": 200}, "kvtrim_context=200 is past the prompt's end"),
    ({"kvtrim_context": 50}, "kvtrim_context=50 needs a method that compresses (this request's is full)"),
    ({"kvtrim": "keydiff:compression_ratio=0.5", "kvtrim_context": 150}, None),
])
def test_the_front_end_and_the_manager_refuse_a_context_alike(xargs, why):
    from kvtrim.vllm.platform import unfit_request

    s = make_scheduler(40)
    params = SamplingParams(max_tokens=10, ignore_eos=True, extra_args=xargs)
    got = unfit_request(s.vllm_config, 150, params)
    assert (got is None) == (why is None) and (why is None or got.startswith(why))
    s.add_request(Request("r0", list(range(100, 250)), params, None))
    assert s.trim.failed.get("r0") == got


def test_the_kv_cache_spec_asks_vllm_for_the_methods_peak():
    """vLLM's start-up check (one `max_model_len` request must fit) passes on a pool smaller than
    `max_model_len` when the server's method bounds what a request holds (KeyDiff `budget=`: budget + block),
    as vLLM's own sliding-window spec does; the same pool fails it under `full`."""
    from vllm.v1.core.kv_cache_utils import check_enough_kv_cache_memory

    from kvtrim.vllm.kv_spec import TrimAttentionSpec, trim_spec

    spec = trim_spec(FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32))
    assert isinstance(spec, TrimAttentionSpec)
    pool = (20 + 1) * spec.page_size_bytes  # 20 usable blocks (320 tokens) and vLLM's null block
    keydiff, full = make_config("keydiff:budget=200:block_size=64"), make_config("full")
    for cfg in (keydiff, full):
        cfg.cache_config.kv_cache_layout = "NHD"  # (the engine core resolves it before the check)
    check_enough_kv_cache_memory(keydiff, {"l0": spec}, pool)
    assert spec.max_memory_usage_bytes(keydiff) == 17 * spec.page_size_bytes  # 264 entries: 17 blocks of 16
    with pytest.raises(ValueError, match="max seq len"):
        check_enough_kv_cache_memory(full, {"l0": spec}, pool)


def test_a_bad_admission_is_refused_at_start():
    from kvtrim.methods.base import KvtrimError

    with pytest.raises(KvtrimError, match=r"^kvtrim_admission must be one of peak, vllm, got 'lazy'$"):
        make_scheduler(12, admission="lazy")


def test_a_failed_compaction_ends_that_request_only():
    """The worker names a request whose compaction failed in the step's output (`FAILED_ATTR`): the scheduler
    ends it with an error instead of freeing blocks by its count, returns all its blocks, and the other
    requests run to their end."""
    from kvtrim.vllm.planning import FAILED_ATTR

    s = make_scheduler(40)
    add(s, 2, 160, 8, "keydiff:compression_ratio=0.75")
    out = s.schedule()  # both prompts complete in this step: both are due
    ids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids])
    setattr(result, FAILED_ATTR, {"r0": "KeyDiff discarded 119 of 160 entries, the scheduler expected 120"})
    outputs = s.update_from_output(out, result)
    ended = [o for client in outputs.values() for o in client.outputs if o.request_id == "r0" and o.finish_reason]
    assert len(ended) == 1 and ended[0].finish_reason.name == "ERROR"
    assert "r0" not in s.requests and s.kvtrim_failed_requests == 1
    assert free_blocks(s) == 40 - held(s, "r1") and held(s, "r1") == 3  # r1 compacted to 40 entries: 3 blocks
    run_all(s)
    assert free_blocks(s) == 40 and not s.trim.states


@pytest.mark.parametrize("ends", ["max_tokens", "eos"])
def test_a_failed_compaction_is_an_error_even_when_its_step_token_ends_the_request(ends):
    """The token sampled in the failing step would end the request (its `max_tokens`, or EOS): the request still
    ends with the error and that token is never handed over (handed over before the error, its client saw a
    success: a 200 with finish_reason "length" or "stop")."""
    from kvtrim.vllm.planning import FAILED_ATTR

    s = make_scheduler(40)
    for i in range(2):
        params = SamplingParams(max_tokens=1 if ends == "max_tokens" else 8, ignore_eos=ends != "eos",
                                extra_args={"kvtrim": "keydiff:compression_ratio=0.75"})
        params.update_from_generation_config({}, eos_token_id=7)  # as vLLM's input processor does
        s.add_request(Request(f"r{i}", list(range(100 + i, 260 + i)), params, None))
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids])
    setattr(result, FAILED_ATTR, {"r0": "KeyDiff discarded 119 of 160 entries, the scheduler expected 120"})
    outputs = [o for client in s.update_from_output(out, result).values() for o in client.outputs]
    got = {r: [(o.new_token_ids, getattr(o.finish_reason, "name", None)) for o in outputs if o.request_id == r]
           for r in ids}  # (FinishReason.STOP is 0)
    assert got == {"r0": [([], "ERROR")], "r1": [([7], "LENGTH" if ends == "max_tokens" else "STOP")]}
    assert s.kvtrim_failed_requests == 1 and free_blocks(s) == 40 and not s.requests


@pytest.mark.parametrize("cache, async_scheduling, words", [
    ({"cache_dtype": "fp8"}, False, "quantised KV cache (--kv-cache-dtype fp8)"),
    (None, True, "async scheduling"),
])
def test_features_that_break_compaction_are_refused_at_start(cache, async_scheduling, words):
    from kvtrim.methods.base import KvtrimError
    from kvtrim.vllm.config import refuse_features

    cfg = make_config(cache=cache)
    # vLLM's CPU platform turns async scheduling off while it builds the config; GPU platforms keep it on
    cfg.scheduler_config.async_scheduling = async_scheduling
    with pytest.raises(KvtrimError, match=re.escape(words)) as err:
        refuse_features(cfg)
    assert "\n" not in str(err.value)


def test_a_kv_connector_is_refused_at_start():
    """A KV connector (`--kv-transfer-config`; `--kv-offloading-size` sets one too) would save or load compacted
    blocks as if they held the request's tokens in order."""
    from vllm.config import KVTransferConfig

    from kvtrim.methods.base import KvtrimError
    from kvtrim.vllm.config import refuse_features

    cfg = make_config()
    cfg.kv_transfer_config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(KvtrimError, match=r"refuses a KV connector .*compacted blocks") as err:
        refuse_features(cfg)
    assert "\n" not in str(err.value)


def test_sliding_window_and_alibi_models_are_refused():
    from kvtrim.methods.base import KvtrimError
    from kvtrim.vllm.config import refuse_features

    cfg = make_config()
    refuse_features(cfg)  # SmolLM2: plain full attention
    cfg.model_config.hf_text_config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(KvtrimError, match=r"sliding-window or hybrid layers \(sliding_attention\)"):
        refuse_features(cfg)
    cfg.model_config.hf_text_config.layer_types = None
    cfg.model_config.hf_text_config.sliding_window = 512
    with pytest.raises(KvtrimError, match="sliding window 512"):
        refuse_features(cfg)
    cfg.model_config.hf_text_config.sliding_window = None
    cfg.model_config.hf_text_config.alibi = True
    with pytest.raises(KvtrimError, match="ALiBi"):
        refuse_features(cfg)
    del cfg.model_config.hf_text_config.alibi
    refuse_features(cfg)


def test_aborted_request_frees_its_blocks():
    s = make_scheduler(40)
    add(s, 2, 160, 50, "keydiff:compression_ratio=0.75")
    step(s)
    step(s)
    s.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert "r0" not in s.trim.states
    assert free_blocks(s) == 40 - held(s, "r1")
    run_all(s)
    assert free_blocks(s) == 40


def test_a_method_that_raises_while_planning_or_admitting_ends_that_request_only():
    """A registered method (as a user installs one) that raises where the manager plans its counts, or where it
    works out its peak to admit it, ends that request with an error (one line) and never stops the engine: the
    other requests run to their end and the pool ends empty."""
    from dataclasses import dataclass

    import kvtrim

    @kvtrim.register_method
    @dataclass
    class PlanBreaker(kvtrim.ScoringMethod):
        name = "test_plan_breaker"
        summary = "raises when told a forward"

        def score(self, view):
            return view.keys.float().norm(dim=-1)

        def target(self, view):
            raise RuntimeError("target broke\nsecond line")

    @kvtrim.register_method
    @dataclass
    class PeakBreaker(PlanBreaker):
        name = "test_peak_breaker"
        summary = "raises when asked its peak"

        def peak_stored(self, prompt_tokens, total_tokens):
            raise ValueError("peak broke")

    s = make_scheduler(40)
    add(s, 1, 160, 8, "test_plan_breaker:compression_ratio=0.5")
    add(s, 1, 160, 8, "test_peak_breaker:compression_ratio=0.5", start=1)
    add(s, 2, 160, 8, "keydiff:compression_ratio=0.75", start=2)
    finished = {}
    for _ in range(200):
        if not s.has_requests():
            break
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        outputs = s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                              sampled_token_ids=sampled))
        finished.update({o.request_id: o.finish_reason.name for c in outputs.values() for o in c.outputs if o.finish_reason})
    assert finished == {"r0": "ERROR", "r1": "ERROR", "r2": "LENGTH", "r3": "LENGTH"}
    assert s.kvtrim_failed_requests == 2 and free_blocks(s) == 40 and not s.trim.states and not s.trim.failed


def test_prompt_end_requests_reserve_nothing_for_their_growth():
    """A prompt-end method keeps every token it decodes (its peak: the kept prompt plus all its `max_tokens`):
    it reserves nothing for that growth and is admitted as vLLM admits (by its prompt), beside what a bounded
    request reserves, which still reserves its peak. By their peaks (8 blocks) a 40-block pool would admit 5."""
    s = make_scheduler(40)
    add(s, 1, 64, 100, "streaming:budget=40")  # bounded: reserves its peak
    add(s, 8, 64, 100, "streaming:compression_ratio=0.75", start=1)  # 64 -> 16 kept, then +100: 8 blocks at the end
    assert len(step(s)) == 9
    assert s.trim.states["r0"].reserved == -(-parse_method_spec("streaming:budget=40").build().peak_stored(64, 164)
                                             // BLOCK)
    assert all(s.trim.states[f"r{i}"].grows and s.trim.states[f"r{i}"].reserved is None for i in range(1, 9))
    run_all(s)
    assert free_blocks(s) == 40 and not s.trim.states


def _hashed_requests(s: TrimScheduler):
    """A function adding requests whose block hashes vLLM's prefix cache computes (prefix caching on)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def send(rid, prompt, spec=None, context=None, max_tokens=5, salt=None):
        extra = {"kvtrim": spec} if spec else {}
        if context is not None:
            extra["kvtrim_context"] = context
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra or None)
        s.add_request(Request(rid, prompt, params, None, block_hasher=hasher, cache_salt=salt))

    return send


def test_a_compressed_context_is_shared_read_only_by_later_requests():
    """A 100-token document compressed at 0.5 by KeyDiff (`kvtrim_context=100`): the first request computes and
    compacts it (50 kept: 3 full blocks and 2 entries) and registers it, with a copy of its last block. A later
    request with the same document and method, another question, starts from it: only its question is computed
    (no forward over the document, no compaction ever), its block table starts with the context's 3 blocks
    (shared), then its own copy of the last block (the worker copies it before the forward); it stores what the
    first one stores. No compaction writes a shared block. Another method, another salt or another document
    computes its own. Pool: what the registry holds stays used; nothing else leaks."""
    s = make_scheduler(60, prefix_caching=True)
    send = _hashed_requests(s)
    doc = list(range(1000, 1100))
    spec = "keydiff:compression_ratio=0.5"
    send("c0", doc + list(range(1, 21)), spec, 100)
    dues = []
    while "c0" in s.requests and not s.trim.contexts.contexts:
        scheduled, due = step(s, plans=True)
        dues.append(due)
    (context,) = s.trim.contexts.contexts.values()
    assert dues[-1]["c0"].registers == (context.id, context.tail.block_id)
    assert (context.tokens, context.kept, len(context.blocks)) == (100, 50, 3)
    assert context.blocks == s.trim.req_to_blocks["c0"][:3] and [b.ref_cnt for b in context.blocks] == [2] * 3
    send("c1", doc + list(range(30, 55)), spec, 100)
    out = s.schedule()
    plan = getattr(out, PLAN_ATTR)
    assert out.num_scheduled_tokens == {"c0": 20, "c1": 25} and s.requests["c1"].num_computed_tokens == 125
    assert plan.adopted == {"c1": (context.id, 50)} and not plan.due
    mine = s.trim.req_to_blocks["c1"]
    assert mine[:3] == context.blocks and plan.copies == ((context.tail.block_id, mine[3].block_id),)
    assert held(s, "c1") == -(-(50 + 25) // BLOCK) and all(b.ref_cnt == 3 for b in context.blocks)
    s.update_from_output(out, ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens),
                                                req_id_to_index={r: i for i, r in enumerate(out.num_scheduled_tokens)},
                                                sampled_token_ids=[[7], [7]]))
    send("k0", doc + list(range(1, 21)), "knorm:compression_ratio=0.5", 100)
    send("c2", doc + list(range(1, 21)), spec, 100, salt="other")
    send("c3", list(range(2000, 2100)) + list(range(1, 21)), spec, 100)
    scheduled, due = step(s, plans=True)
    # each compresses its own context (KNorm from the document's 6 full blocks, cached by c0 before compressing)
    assert (scheduled["k0"], scheduled["c2"], scheduled["c3"]) == (4, 100, 100)
    assert all(due[rid].registers is not None for rid in ("k0", "c2", "c3"))
    shared = {b.block_id for b in context.held()}
    while s.has_requests():
        scheduled, due = step(s, plans=True)
        for rid, d in due.items():  # a compaction writes its request's first slots: never a shared block
            assert not shared & {b.block_id for b in s.trim.req_to_blocks[rid][:-(-(d.end - d.discarded) // BLOCK)]}
        assert "c1" not in due
    assert len(s.trim.contexts.contexts) == 4 and not s.trim.states  # c0's, k0's, c2's, c3's
    assert free_blocks(s) == 60 - s.trim.contexts.held_blocks()


def test_idle_contexts_go_back_least_recently_used_first_when_room_is_needed():
    """Three 100-token documents compressed at 0.5 (4 blocks each, held by the registry) on a 20-block pool: a
    request needing 12 blocks releases the least recently used idle ones, in that order, the worker is told
    which; a context a running request reads is never released; a question about a released document computes
    it again (and registers it again)."""
    s = make_scheduler(20, prefix_caching=True)
    send = _hashed_requests(s)
    spec = "keydiff:compression_ratio=0.5"
    docs = [list(range(1000 * d, 1000 * d + 100)) for d in (1, 2, 3)]
    for d, doc in enumerate(docs):
        send(f"c{d}", doc + [1, 2, 3], spec, 100, max_tokens=1)
        run_all(s)
    ids = [c.id for c in s.trim.contexts.contexts.values()]
    assert len(ids) == 3 and free_blocks(s) == 20 - 12
    send("r0", docs[0] + [4, 5], spec, 100, max_tokens=30)  # reads (and refreshes) document 0: 5 blocks
    step(s)
    send("big", list(range(50, 230)), None, max_tokens=12)  # 180 tokens: 12 blocks, 7 free
    out = s.schedule()
    assert "big" in out.num_scheduled_tokens and getattr(out, PLAN_ATTR).released == (ids[1], ids[2])
    assert [c.id for c in s.trim.contexts.contexts.values()] == [ids[0]]
    s.update_from_output(out, ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens),
                                                req_id_to_index={r: i for i, r in enumerate(out.num_scheduled_tokens)},
                                                sampled_token_ids=[[7] for _ in out.num_scheduled_tokens]))
    run_all(s)
    send("again", docs[1] + [6], spec, 100, max_tokens=1)
    assert step(s) == {"again": 100}  # its context, computed again (its blocks were taken too)
    run_all(s)
    assert len(s.trim.contexts.contexts) == 2 and free_blocks(s) == 20 - s.trim.contexts.held_blocks()


def test_aborts_while_a_context_is_shared_or_registered_leave_nothing_behind():
    """A request aborted after its context's compaction was planned, before it ran: nothing is registered and
    the copy of its last block goes back. A reader aborted mid-decode: its own blocks go back, the context's stay
    (the registry's reference), and a later reader still starts from it. Then the pool holds only the context."""
    from vllm.v1.request import RequestStatus

    s = make_scheduler(40, prefix_caching=True)
    send = _hashed_requests(s)
    doc, spec = list(range(1000, 1100)), "keydiff:compression_ratio=0.5"
    send("c0", doc + [1, 2, 3], spec, 100)
    out = s.schedule()
    assert getattr(out, PLAN_ATTR).due["c0"].registers is not None
    s.finish_requests("c0", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out, ModelRunnerOutput(req_ids=["c0"], req_id_to_index={"c0": 0}, sampled_token_ids=[[]]))
    assert not s.trim.contexts.contexts and free_blocks(s) == 40 and not s.trim.states
    send("c1", doc + [4, 5], spec, 100, max_tokens=30)
    step(s)
    step(s)  # c1's context registered, then its question
    (context,) = s.trim.contexts.contexts.values()
    send("r0", doc + [6, 7], spec, 100, max_tokens=30)
    for _ in range(5):
        step(s)
    assert s.trim.states["r0"].reads is context and all(b.ref_cnt == 3 for b in context.blocks)
    s.finish_requests("r0", RequestStatus.FINISHED_ABORTED)
    assert all(b.ref_cnt == 2 for b in context.blocks) and "r0" not in s.trim.states
    send("r1", doc + [8], spec, 100)
    assert step(s, plans=True)[1] == {} and s.trim.states["r1"].reads is context
    run_all(s)
    assert [b.ref_cnt for b in context.held()] == [1] * 4 and free_blocks(s) == 40 - 4


def test_resetting_the_prefix_cache_forgets_the_shared_contexts():
    """vLLM's `reset_prefix_cache` (`/reset_prefix_cache`): the registry lets go of its contexts (the worker is
    told with the next step), the reset succeeds with every block free, and a later question computes its context
    again."""
    s = make_scheduler(40, prefix_caching=True)
    send = _hashed_requests(s)
    doc, spec = list(range(1000, 1100)), "keydiff:compression_ratio=0.5"
    send("c0", doc + [1, 2], spec, 100, max_tokens=1)
    run_all(s)
    (context,) = s.trim.contexts.contexts.values()
    assert free_blocks(s) == 40 - 4
    assert s.reset_prefix_cache() and free_blocks(s) == 40 and not s.trim.contexts.contexts
    send("c1", doc + [3], spec, 100, max_tokens=1)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"c1": 100} and getattr(out, PLAN_ATTR).released == (context.id,)


def test_preempted_readers_of_a_shared_context_start_from_it_again():
    """Admission as vLLM's (`--admission vllm`) on a 16-block pool: a registered context (4 blocks) and five readers
    of 100 new tokens each, admitted by their questions and preempted as they grow; each preempted reader starts
    from the context again (its tokens after the context recomputed as one forward, no compaction ever), every one
    gets its tokens, and the pool ends holding only the context."""
    s = make_scheduler(16, prefix_caching=True, admission="vllm")
    send = _hashed_requests(s)
    doc, spec = list(range(1000, 1100)), "keydiff:compression_ratio=0.5"
    send("c0", doc + [1, 2], spec, 100, max_tokens=1)
    run_all(s)
    (context,) = s.trim.contexts.contexts.values()
    for i in range(5):
        send(f"r{i}", doc + [10 + i] * 20, spec, 100, max_tokens=100)
    starts, preempted, done = 0, 0, {}
    for _ in range(3000):
        if not s.has_requests():
            break
        out = s.schedule()
        plan = getattr(out, PLAN_ATTR)
        assert not plan.due and all(c == context.id for c, _ in plan.adopted.values())
        starts += len(plan.adopted)
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        for r in ids:
            preempted = max(preempted, s.requests[r].num_preemptions)
            done[r] = len(s.requests[r].output_token_ids) + len(sampled[ids.index(r)])
        s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                    sampled_token_ids=sampled))
    assert not s.has_requests() and preempted > 0 and starts > 5
    assert all(done[f"r{i}"] == 100 for i in range(5))
    assert free_blocks(s) == 16 - 4 and [b.ref_cnt for b in context.held()] == [1] * 4


def _outcomes(s: TrimScheduler, limit: int = 3000) -> dict[str, str]:
    """Steps until every request is done; returns each request's finish reason (and its `stop_reason` for an
    error)."""
    finished = {}
    for _ in range(limit):
        if not s.has_requests():
            return finished
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        outputs = s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                              sampled_token_ids=sampled))
        finished.update({o.request_id: o.finish_reason.name + (f" {o.stop_reason}" if o.finish_reason.name == "ERROR" else "")
                         for c in outputs.values() for o in c.outputs if o.finish_reason})
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("questions", [2, 8])
def test_many_questions_about_one_document_in_one_step_register_it_once(questions):
    """`questions` requests naming the same 100-token context, sent at once (their context's compactions are planned
    in the same step): one registers the context, the others compress their own copy (the engine went down on the
    second registration of one key before); all answer, and later questions start from the one context."""
    s = make_scheduler(80, prefix_caching=True)
    send = _hashed_requests(s)
    doc, spec = list(range(1000, 1100)), "keydiff:compression_ratio=0.5"
    for i in range(questions):
        send(f"q{i}", doc + [10 + i] * 5, spec, 100, max_tokens=4)
    scheduled, due = step(s, plans=True)
    assert len(scheduled) == questions and all(d.steps[0].ends_prompt for d in due.values())
    assert sum(d.registers is not None for d in due.values()) == 1
    finished = _outcomes(s)
    assert finished == {f"q{i}": "LENGTH" for i in range(questions)}
    (context,) = s.trim.contexts.contexts.values()
    assert not s.trim.contexts.pending and (context.tokens, context.kept) == (100, 50)
    send("late", doc + [99] * 3, spec, 100, max_tokens=2)
    out = s.schedule()
    assert getattr(out, PLAN_ATTR).adopted == {"late": (context.id, 50)}


def test_a_preempted_whole_prompt_writer_never_registers_its_generated_tokens():
    """`kvtrim_context` = the whole prompt: a writer whose context's registration did not happen (the context was
    registered then; the registry was reset after), preempted after decoding, is recomputed from its prompt and the
    tokens it generated in one forward; its compaction after that forward holds generated tokens, so it registers
    nothing (before, it registered the context as 100 + generated tokens: later readers started from another
    request's answer, and a reader shorter than that stopped the engine)."""
    s = make_scheduler(80, prefix_caching=True)
    send = _hashed_requests(s)
    doc, spec = list(range(1000, 1100)), "keydiff:compression_ratio=0.5"
    send("first", doc, spec, 100, max_tokens=1)
    _outcomes(s)
    send("writer", doc, spec, 100, max_tokens=40)
    for _ in range(10):
        step(s)
    s.reset_prefix_cache()  # the writer's context is registered nowhere now
    writer = s.requests["writer"]
    generated = len(writer.output_token_ids)
    assert generated >= 5
    s.running.remove(writer)
    s._preempt_request(writer, 0.0)  # (vLLM's own preemption, as when the pool runs out)
    scheduled, due = step(s, plans=True)
    assert scheduled["writer"] == 100 + generated and due["writer"].registers is None
    assert _outcomes(s) == {"writer": "LENGTH"}
    assert all(c.tokens == 100 for c in s.trim.contexts.contexts.values())
    send("reader", doc[:99] + [5, 6], spec, 100, max_tokens=2)  # another question on the same 100 tokens' key
    assert _outcomes(s) == {"reader": "LENGTH"}


def _breaker(hook: str):
    """A registered `ScoringMethod` whose `hook` raises (`schedule`, `__repr__`, `prefill_block_size`,
    `peak_stored`, `target`: what the scheduler asks a method)."""
    from dataclasses import dataclass

    import kvtrim

    def broken(self, *args, **kwargs):
        raise RuntimeError(f"{hook} broke\nsecond line")

    cls = dataclass(type(f"Breaks_{hook.strip('_')}", (kvtrim.ScoringMethod,), {
        "name": f"test_breaks_{hook.strip('_')}", "summary": "raises in one hook",
        "score": lambda self, view: view.keys.float().norm(dim=-1), hook: broken}))
    kvtrim.register_method(cls, replace=True)
    return f"test_breaks_{hook.strip('_')}:compression_ratio=0.5"


@pytest.mark.parametrize("hook", ["schedule", "__repr__", "prefill_block_size", "peak_stored", "target"])
@pytest.mark.parametrize("context", [None, 100])
def test_a_method_raising_in_any_scheduler_side_call_ends_only_its_request(hook, context):
    """A user method that raises in what the scheduler asks it (when its request is added or planned, with or
    without a context) ends its request with an error whose `stop_reason` carries the one line, in the step
    it is added or planned (the server's front end refuses it first, a 400 with the line); the requests queued after it are admitted in the same step (not held behind it) and
    answer; nothing is left in the pool or the manager."""
    s = make_scheduler(60, prefix_caching=True)
    send = _hashed_requests(s)
    spec = _breaker(hook)
    send("bad", list(range(1000, 1120)), spec, context, max_tokens=4)
    send("good0", list(range(2000, 2120)), "keydiff:compression_ratio=0.5", context, max_tokens=4)
    send("good1", list(range(3000, 3050)), None, max_tokens=4)
    assert set(s.schedule().num_scheduled_tokens) >= {"good0", "good1"}
    s.finish_requests(list(s.requests), RequestStatus.FINISHED_ABORTED)
    s.update_from_output(s.schedule(), ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[]))
    s.reset_prefix_cache()
    assert free_blocks(s) == 60
    send("bad", list(range(1000, 1120)), spec, context, max_tokens=4)
    send("good0", list(range(2000, 2120)), "keydiff:compression_ratio=0.5", context, max_tokens=4)
    send("good1", list(range(3000, 3050)), None, max_tokens=4)
    finished = _outcomes(s)
    assert finished["good0"] == finished["good1"] == "LENGTH", finished
    # the server's front end asks the method the same (`ask_as_the_scheduler`): a 400 with the line instead
    from kvtrim.vllm.platform import unfit_request

    extra = {"kvtrim": spec} | ({"kvtrim_context": context} if context else {})
    front = unfit_request(s.vllm_config, 120, SamplingParams(max_tokens=4, extra_args=extra))
    if hook == "__repr__" and context is None:  # (only a context's key reads it)
        assert finished["bad"] == "LENGTH"
    else:
        assert finished["bad"].startswith("ERROR kvtrim: ") and f"{hook} broke" in finished["bad"], finished
        assert "\n" not in finished["bad"]
        assert front is not None and f"{hook} broke" in front and "\n" not in front, front
    assert not s.trim.states and not s.trim.failed and not s.trim.contexts.pending
    assert free_blocks(s) == 60 - s.trim.contexts.held_blocks()


def test_a_context_abandoned_before_its_registration_is_forgotten_by_the_worker():
    """A request aborted (or preempted) between the step that compacts its context and that step's update: the
    worker has kept the context's entries for the id the plan named; the next step's plan names it released, so
    the worker forgets them, and the key is free for the next question to register."""
    s = make_scheduler(40, prefix_caching=True)
    send = _hashed_requests(s)
    doc, spec = list(range(1000, 1100)), "keydiff:compression_ratio=0.5"
    send("c0", doc + [1, 2, 3], spec, 100)
    out = s.schedule()
    pending = getattr(out, PLAN_ATTR).due["c0"].registers[0]
    s.finish_requests("c0", RequestStatus.FINISHED_ABORTED)  # (vLLM processes aborts before the step's update)
    s.update_from_output(out, ModelRunnerOutput(req_ids=["c0"], req_id_to_index={"c0": 0}, sampled_token_ids=[[]]))
    assert getattr(s.schedule(), PLAN_ATTR).released == (pending,)
    assert not s.trim.contexts.pending and not s.trim.contexts.contexts and free_blocks(s) == 40
    send("c1", doc + [4], spec, 100, max_tokens=1)
    _, due = step(s, plans=True)
    assert due["c1"].registers is not None and due["c1"].registers[0] != pending


def test_an_admission_that_fails_anyway_releases_no_context():
    """Sizing a waiting request that the pool cannot take even with every idle context released lets none of them
    go (vLLM sizes an admission, then may not make it); one that fits once they go releases them."""
    s = make_scheduler(24, prefix_caching=True)
    send = _hashed_requests(s)
    spec = "keydiff:compression_ratio=0.5"
    for d in (1, 2, 3):
        send(f"c{d}", list(range(1000 * d, 1000 * d + 100)) + [1], spec, 100, max_tokens=1)
        _outcomes(s)
    assert len(s.trim.contexts.contexts) == 3 and free_blocks(s) == 24 - 12
    send("long", list(range(50, 150)), None, max_tokens=200)  # 7 blocks, then grows
    step(s)
    send("big", list(range(5000, 5300)), None, max_tokens=2)  # 19 blocks: 5 free + 12 idle is not enough
    out = s.schedule()
    assert "big" not in out.num_scheduled_tokens and len(s.trim.contexts.contexts) == 3
    assert getattr(out, PLAN_ATTR).released == ()


@pytest.mark.parametrize("spec, prompt, new_tokens, context", [
    ("lazyeviction:budget=64:window=8", 20, 5, None),  # never over its budget, yet due at every decode step
    ("lazyeviction:budget=64:window=8", 100, 5, 50),  # its context's question appended whole before its first step
    ("tova:budget=64", 20, 60, None), ("keydiff:compression_ratio=0.75", 100, 5, None),
    ("streaming:budget=40", 100, 30, 50)])
def test_a_request_sharing_cached_blocks_reserves_every_copy_its_first_compaction_writes(spec, prompt, new_tokens,
                                                                                          context):
    """A request that starts from cached blocks takes, when admitted, the spare blocks its first compaction copies
    the shared ones into: never fewer than it copies (before, a LazyEviction request under its budget reserved
    none and one whose context's question came whole reserved too few; on a full pool the copy found no block and
    the request failed: seen in the chaos load)."""
    s = make_scheduler(200, prefix_caching=True)
    send = _hashed_requests(s)
    tokens = list(range(1000, 1000 + prompt))
    send("a", tokens, None, None, max_tokens=new_tokens)  # caches the prompt's full blocks
    _outcomes(s)
    send("b", tokens, spec, context, max_tokens=new_tokens)
    state = s.trim.states["b"]
    assert state.shares
    spares, first = state.spares_needed, None  # (taken when it is admitted)
    while first is None and s.has_requests():
        _, due = step(s, plans=True)
        first = due.get("b")
    assert first is not None and first.copies and len(first.copies) <= spares, (first, spares)
    assert _outcomes(s) == {"b": "LENGTH"}
