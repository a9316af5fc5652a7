"""End to end on 127.0.0.1 with the `openai` client: `kvtrim serve` (vLLM's OpenAI server + kvtrim's worker).

Run from .venv-serve (`make test` does: make serve-env, then .venv-serve/bin/python -m pytest tests/test_vllm_*.py);
skipped where vLLM or the openai client is missing. Greedy decoding, bf16 where the CPU computes in it natively, else
float32 (`vllm_server.SERVER_DTYPE`)."""

import concurrent.futures
import os

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")
openai = pytest.importorskip("openai")

from vllm_server import SERVER_DTYPE, Server  # noqa: E402

from kvtrim.models import resolve_model_dir  # noqa: E402
from kvtrim.passkey import passkey_samples  # noqa: E402

pytestmark = pytest.mark.integration
NEW_TOKENS = 12


#: a folder with a test plugin (a method registered through the `kvtrim.methods` entry point) that breaks the
#: engine's contract: on the server's PYTHONPATH, so that every server process finds it as an installed method
CONTRACT_BREAKER = os.path.join(os.path.dirname(__file__), "data", "contract_breaker")


@pytest.fixture(scope="module")
def server():
    # the caller's PYTHONPATH stays after it (PYTHONPATH=src: the server runs the kvtrim under test)
    path = os.pathsep.join(filter(None, [CONTRACT_BREAKER, os.environ.get("PYTHONPATH")]))
    s = Server(method="full", env_extra={"PYTHONPATH": path})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain():
    s = Server(plain=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    return passkey_samples(tok, 900, 10, seed=24)


def complete(url: str, prompts: list[str], xargs: dict | None = None, max_tokens: int = NEW_TOKENS,
             ignore_eos: bool = False, at_once: int = 8) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    extra = ({"vllm_xargs": xargs} if xargs else {}) | ({"ignore_eos": True} if ignore_eos else {})

    def one(p):
        r = client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0, extra_body=extra)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:  # concurrent requests: vLLM batches them
        return list(pool.map(one, prompts))


def test_full_is_plain_vllm(server, plain, prompts):
    # one request at a time: vLLM's "amx" kernel (bfloat16 on AMX CPUs) gives plain vLLM itself a different greedy
    # text when the same requests arrive batched differently (measured: concurrent != concurrent again)
    # prefix caching on in both (vLLM's default): the passkey prompts share their first blocks, and the second
    # round finds every prompt cached; on that kernel a hit changes greedy texts too, the same way in both
    texts = [s.prompt for s in prompts[:4]] + ["The capital of France is", "def fibonacci(n):"]
    expected = complete(plain.url, texts, at_once=1)
    assert complete(server.url, texts, at_once=1) == expected  # the server's default: full
    expected = complete(plain.url, texts, at_once=1)
    assert complete(server.url, texts, {"kvtrim": "full"}, at_once=1) == expected
    assert " entries after its prompt (" not in server.tail(400)  # full compacts nothing


def test_the_attention_hand_off_is_in_every_layer(server):
    """`python -m vllm.entrypoints.openai.api_server` with kvtrim's flags (what `kvtrim serve` starts) builds
    kvtrim's CPU attention backend in every layer of SmolLM2 (30): the worker registers it when vLLM imports it.
    vLLM allocates the 30 layers' caches back to back in one allocation: the compaction moves entries in one copy
    for all (`kvtrim.vllm.block_io.layers_as_blocks`); the decode steps' probabilities come from kvtrim's kernel
    (`kvtrim.vllm.kernels`: this machine has a compiler, as vLLM's CPU build needs)."""
    log = server.tail(100000)
    assert "kvtrim: attention hand-off on 30 layers" in log
    assert "kvtrim: the KV caches of the 30 layers lie back to back: one copy moves entries in all" in log
    assert "kvtrim: decode-step probabilities of the methods fed attention by kvtrim's C++ kernel" in log


@pytest.mark.parametrize("spec", ["nope", "kvzip:compression_ratio=0.5", "keydiff:compression_ratio=2", "snapkv:compression_ratio=0.5:block_size=64",
                                  "lagkv:compression_ratio=0.5:skip_layers=0", ["lagkv"]])
def test_bad_spec_is_400_and_the_server_goes_on(server, spec):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="Hello", max_tokens=2, extra_body={"vllm_xargs": {"kvtrim": spec}})
    message = err.value.body["message"] if isinstance(err.value.body, dict) else str(err.value)
    assert err.value.status_code == 400 and message.startswith("kvtrim: ") and "\n" not in message
    assert complete(server.url, ["The capital of France is"])[0]


@pytest.mark.parametrize("spec", ["lagkv:compression_ratio=0.5", "keydiff:compression_ratio=0.5"])
def test_passkey_at_half_the_cache(server, prompts, spec):
    texts = [s.prompt for s in prompts]
    full = complete(server.url, texts)
    assert sum(s.key in t for s, t in zip(prompts, full)) >= 9  # the full cache finds them
    before = server.tail(100000).count(" entries after its prompt (")
    evicted = complete(server.url, texts, {"kvtrim": spec})
    log = server.tail(100000)
    assert log.count(" entries after its prompt (") - before == len(texts)  # every request was compacted once
    found_full = [s.key in t for s, t in zip(prompts, full)]
    found = [s.key in t for s, t in zip(prompts, evicted)]
    print(f"{spec}: full found {sum(found_full)}/{len(texts)}, evicted found {sum(found)}/{len(texts)}")
    assert sum(a and not b for a, b in zip(found_full, found)) <= 1, (full, evicted)


#: passkeys found by the same method in transformers on these 10 prompts (40 greedy tokens; the full cache finds
#: 10/10), per the servers' dtype. bf16: `model.generate(tok(prompt).input_ids, cache=TrimCache(method),
#: max_new_tokens=40, min_new_tokens=40)` on `load_model("smollm2-135m", dtype="bfloat16")`, where LagKV's reference
#: mode at L = 32 loses two needles too (2026-12-04); KeyDiff reads its prompt in blocks of 16 in the engine since
#: 2026-12-05, and `kvtrim.generate` (the prompt in those blocks) finds 10/10 too. Float32: `kvtrim.generate` for
#: all (tests/data/passkey_found.py, 2026-12-07): the full cache and KeyDiff 10/10, LagKV 9/10
FOUND_IN_TRANSFORMERS = {"bfloat16": {"lagkv:lag_size=32": 8, "keydiff:budget=450:block_size=16": 10},
                         "float32": {"lagkv:lag_size=32": 9, "keydiff:budget=450:block_size=16": 10}}


@pytest.mark.parametrize("spec", list(FOUND_IN_TRANSFORMERS[SERVER_DTYPE]))
def test_passkey_with_evictions_while_decoding(server, prompts, spec):
    """LagKV's reference mode (every 32 tokens) and KeyDiff's budget mode (back to 450 entries every 16
    tokens) compact at the prompt's end and again while decoding; they find as many passkeys as the same
    method in transformers, less at most one (the kernels differ). Transformers' count in the servers' dtype:
    `FOUND_IN_TRANSFORMERS` (how each was measured: the comment above it)."""
    texts = [s.prompt for s in prompts]
    full = complete(server.url, texts, max_tokens=40, ignore_eos=True)
    import re
    import time

    ended = r"ended after (\d+) compactions past its prompt"
    before = len(re.findall(ended, server.tail(100000)))
    evicted = complete(server.url, texts, {"kvtrim": spec}, max_tokens=40, ignore_eos=True)
    for _ in range(100):  # one line per request, when the worker hears it ended (the step after its last token)
        counts = [int(n) for n in re.findall(ended, server.tail(100000))[before:]]
        if len(counts) >= len(texts):
            break
        time.sleep(0.1)
    decodes = sum(counts)
    assert len(counts) == len(texts) and min(counts) >= 1, counts  # each compacted again while decoding
    assert " entries after its decode (" not in server.tail(100000)  # those lines are at debug level
    found_full = [s.key in t for s, t in zip(prompts, full)]
    found = [s.key in t for s, t in zip(prompts, evicted)]
    print(f"{spec}: full found {sum(found_full)}/{len(texts)}, evicted found {sum(found)}/{len(texts)}, "
          f"{decodes} decode-time compactions")
    assert sum(found_full) >= 9 and sum(found) >= FOUND_IN_TRANSFORMERS[SERVER_DTYPE][spec] - 1, (full, evicted)
    wait_idle(server.url)


def gauge(url: str, name: str) -> float:
    """A gauge of vLLM's Prometheus `/metrics` (summed over its label sets)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def wait_idle(url: str, timeout: float = 60, held: int = 0, pool: int = 127) -> None:
    """Wait until the server runs no request and holds no block of its `pool` but the `held` ones of the shared
    contexts it keeps (`context_blocks`)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gauge(url, "vllm:num_requests_running") == 0 and gauge(url, "vllm:kv_cache_usage_perc") * pool == pytest.approx(held):
            return
        time.sleep(0.5)
    raise AssertionError(f"the server kept requests or blocks: running={gauge(url, 'vllm:num_requests_running')}, "
                         f"kv usage={gauge(url, 'vllm:kv_cache_usage_perc')}, {held} blocks of shared contexts")


def context_blocks(server) -> int:
    """The blocks the server's shared compressed contexts hold, as its last line about them says."""
    import re

    said = re.findall(r"shared contexts hold (\d+) blocks", server.tail(100000))
    return int(said[-1]) if said else 0


def ask(url: str, prompt: str, spec: str | None = None, salt: str | None = None) -> tuple[str, int]:
    """One greedy completion of `prompt` (`spec`: its kvtrim method; `salt`: vLLM's `cache_salt`, which keeps its
    cached blocks apart from other salts'): its text and its prompt's token count."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    extra = ({"vllm_xargs": {"kvtrim": spec}} if spec else {}) | ({"cache_salt": salt} if salt else {})
    r = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=NEW_TOKENS,
                                  temperature=0, extra_body=extra)
    return r.choices[0].text, r.usage.prompt_tokens


def test_prefix_caching_is_shared_and_compactions_never_write_a_cached_block(server, prompts):
    """vLLM's prefix caching stays on in `kvtrim serve`. A prompt-end compacting request (KeyDiff) starts from the
    prompt's cached blocks and caches its own until its compaction, which writes only fresh copies: a `full`
    request reading what KeyDiff cached answers exactly as one reading what `full` cached (each `cache_salt` its
    own cache; each answer read from cached blocks, the same way), and a cached prompt that KeyDiff compacted from
    answers `full` as before. vLLM's prefix-cache hit counter grows by the prompt's full blocks at each hit."""
    prompt, keydiff = prompts[6].prompt, "keydiff:compression_ratio=0.5"
    hits = lambda: gauge(server.url, "vllm:prefix_cache_hits_total")  # noqa: E731 - (tokens)
    _, n = ask(server.url, prompt, salt="full")  # cached by `full`
    cached = (n - 1) // 128 * 128  # vLLM's hit: the full blocks of 128 before the last token
    before = hits()
    full_warm, _ = ask(server.url, prompt, salt="full")
    keydiff_warm, _ = ask(server.url, prompt, keydiff, salt="full")  # from the cached blocks, written as copies
    assert hits() == before + 2 * cached
    assert ask(server.url, prompt, salt="full")[0] == full_warm  # the cache it read is as it was
    assert ask(server.url, prompt, keydiff, salt="full")[0] == keydiff_warm
    ask(server.url, prompt, keydiff, salt="keydiff")  # cached by KeyDiff, before its compaction
    before = hits()
    assert ask(server.url, prompt, salt="keydiff")[0] == full_warm and hits() == before + cached
    wait_idle(server.url)


@pytest.fixture(scope="module")
def server_f32():
    s = Server(method="full", extra=["--dtype", "float32"])
    yield s
    s.stop()


@pytest.mark.parametrize("spec", ["keydiff:compression_ratio=0.5", "lagkv:compression_ratio=0.5",
                                  "streaming:budget=256", "tova:budget=256", "lazyeviction:budget=256"])
def test_prefix_caching_on_answers_as_off_float32(server_f32, prompts, spec):
    """Float32: a request whose prompt is found cached (by an earlier one of the same method and salt) answers
    exactly as the one that computed it all, which is what it answers with prefix caching off."""
    prompt = prompts[7].prompt
    cold, n = ask(server_f32.url, prompt, spec, salt=spec)
    before = gauge(server_f32.url, "vllm:prefix_cache_hits_total")
    assert ask(server_f32.url, prompt, spec, salt=spec)[0] == cold
    assert gauge(server_f32.url, "vllm:prefix_cache_hits_total") == before + (n - 1) // 128 * 128
    wait_idle(server_f32.url)


@pytest.mark.parametrize("spec", ["tova:budget=64", "h2o:budget=64"])
def test_decode_steps_decided_in_a_batch_answer_as_alone_float32(server_f32, prompts, spec):
    """Requests of one method decoding at once, each evicting one entry per step, have their steps decided as one
    batch (`kvtrim.vllm.live_batch`: the stats line's `batched=` grows) and leave it as they end; float32, each
    answers token for token what it answers alone (one request at a time: no batch). (LazyEviction's requests batch
    only when vLLM starts their decoding in the same step, which four concurrent HTTP requests do not ensure: 0, 22
    or 39 of its 44 steps here; its batches are checked against each request alone in tests/test_vllm_live_batch.py.)"""
    import re

    def batched_so_far() -> int:
        # a prompt's compaction logs the stats line (else one every 16 steps): one more request, alone, one token
        complete(server_f32.url, [prompts[5].prompt], {"kvtrim": spec}, max_tokens=1)
        wait_idle(server_f32.url)
        return int(re.findall(r"kvtrim: stats .*batched=(\d+)", server_f32.tail(100000))[-1])

    texts = [s.prompt for s in prompts[:4]]
    alone = complete(server_f32.url, texts, {"kvtrim": spec}, max_tokens=20, ignore_eos=True, at_once=1)
    before = batched_so_far()
    together = complete(server_f32.url, texts, {"kvtrim": spec}, max_tokens=20, ignore_eos=True, at_once=4)
    after = batched_so_far()
    print(f"{spec}: {after - before} decode steps decided in batches")
    assert together == alone
    # of the 4 x 19 decode steps after the first, those of requests that step together: 70-71 measured, 36 once (the
    # four prompts scheduled apart)
    assert after > before + 20, (before, after)


#: `kvtrim.compress` then `generate` in transformers, float32 (tests/data/context_reference/make.py)
CONTEXT_ANSWERS = os.path.join(os.path.dirname(__file__), "data", "context_reference", "answers.json")


@pytest.mark.parametrize("spec", ["keydiff:compression_ratio=0.5", "snapkv:compression_ratio=0.5",
                                  "lagkv:compression_ratio=0.5", "tova:budget=256", "h2o:budget=256"])
def test_a_context_compressed_on_its_own_answers_as_kvtrim_compress(server_f32, spec):
    """`vllm_xargs: {"kvtrim": SPEC, "kvtrim_context": N}`: the method is told the prompt's first N tokens as its
    prompt (compressed query-agnostically: SnapKV on the context's own last window, H2O on its own attention), the
    rest of the prompt (the question) is read after it: float32, the greedy tokens are those of
    `kvtrim.compress(model, context, method)` then `ctx.generate(question)` in transformers, token for token,
    also when the same request was sent before: a method whose compressed context requests share
    (`shares_context`: KeyDiff, SnapKV, LagKV at a ratio) then starts from the compressed context the first one
    registered (no forward over it, no compaction: the worker logs it); any other finds the context's blocks in
    vLLM's prefix cache (only those inside the context, so that its compaction runs), H2O none."""
    import json

    with open(CONTEXT_ANSWERS) as f:
        ref = json.load(f)
    client = openai.OpenAI(base_url=server_f32.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    for k, case in enumerate(ref["answers"][spec]):
        ids = case["prompt_ids"]
        context = len(ids) - ref["question_tokens"]
        for salt in ("cold", "warm"):  # the same salt twice: the second finds the context's blocks cached
            before = gauge(server_f32.url, "vllm:prefix_cache_hits_total")
            started = server_f32.tail(100000).count("starts from a shared context")
            r = client.completions.create(model=model, prompt=ids, max_tokens=ref["new_tokens"], temperature=0,
                                          extra_body={"vllm_xargs": {"kvtrim": spec, "kvtrim_context": context},
                                                      "cache_salt": f"context {spec} {k}"})
            assert r.choices[0].text == case["answer"], (salt, r.choices[0].text, case["answer"])
            assert f" of {context} entries after its prompt (" in server_f32.tail(100000)  # compressed at the context
            found = gauge(server_f32.url, "vllm:prefix_cache_hits_total") - before
            warm_shared = salt == "warm" and spec.split(":")[0] in ("keydiff", "snapkv", "lagkv")
            assert server_f32.tail(100000).count("starts from a shared context") == started + warm_shared
            if not warm_shared:
                shares = "h2o" not in spec  # (it needs every prompt row's attention)
                assert found == ((context - 1) // 128 * 128 if salt == "warm" and shares else 0), (salt, found)
    wait_idle(server_f32.url, held=context_blocks(server_f32))


def test_many_questions_about_one_document_at_once_answer_as_one_by_one_float32(server_f32, prompts):
    """Eight questions about one ~900-token document sent at once, each naming the document as its context
    (LagKV at 0.75), then three documents x four questions interleaved: every one is answered (the engine went down
    on the second registration of one context in a step), token for token as when the same questions are sent one
    by one (another `cache_salt`: the first registers the context, the others start from it); one context per
    document is registered in each salt; the server serves afterwards and holds only those contexts."""
    import re

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    docs = [tok(prompts[i].prompt).input_ids for i in range(3)]
    asks = [" The pass key is", " Remember the key:", " What was the key?", " Key:", " The number to remember is",
            " Answer with the key.", " The code is", " So the pass key is"]
    questions = [tok(q, add_special_tokens=False).input_ids for q in asks]
    spec = "lagkv:compression_ratio=0.75"
    jobs = [(0, q) for q in range(8)] + [(d, q) for q in range(4) for d in range(3)]
    client = openai.OpenAI(base_url=server_f32.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(job, salt):
        d, q = job
        r = client.completions.create(model=model, prompt=docs[d] + questions[q], max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"vllm_xargs": {"kvtrim": spec, "kvtrim_context": len(docs[d])},
                                                  "cache_salt": salt})
        return r.choices[0].text

    registered = lambda: len(re.findall(r"shares its context", server_f32.tail(100000)))  # noqa: E731
    before = registered()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        eight = list(pool.map(lambda job: one(job, "at once"), jobs[:8]))
        rest = list(pool.map(lambda job: one(job, "at once"), jobs[8:]))
    assert registered() - before == 3  # one per document, however many asked at once
    alone = [one(job, "one by one") for job in jobs]
    assert eight + rest == alone
    assert registered() - before == 6
    assert complete(server_f32.url, ["The capital of France is"])[0]  # the server goes on
    wait_idle(server_f32.url, held=context_blocks(server_f32))


@pytest.mark.parametrize("xargs, words", [
    ({"kvtrim_context": "12"}, "kvtrim_context must be the number of leading prompt tokens"),
    ({"kvtrim_context": 0}, "kvtrim_context must be the number of leading prompt tokens"),
    ({"kvtrim_context": 1.5}, "kvtrim_context must be the number of leading prompt tokens"),
    ({"kvtrim_context": 4}, "kvtrim_context=4 needs a method that compresses (this request's is full)"),
    ({"kvtrim": "keydiff:compression_ratio=0.5", "kvtrim_context": 50}, "kvtrim_context=50 is past the prompt's end"),
])
def test_a_bad_context_is_400_in_one_line(server, xargs, words):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                  max_tokens=4, extra_body={"vllm_xargs": xargs})
    assert words in err.value.message and "\n" not in err.value.message


def test_a_method_that_fails_on_the_request_is_400_in_one_line(server):
    """An installed method whose `schedule` raises (what the scheduler asks every request's method when it adds it):
    the front end asks it first and answers a 400 with the method's one line; the server goes on."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=client.models.list().data[0].id, prompt="The capital of France is",
                                  max_tokens=4, extra_body={"vllm_xargs": {"kvtrim": "raises_in_schedule:budget=8"}})
    assert "schedule failed on purpose" in err.value.message and "\n" not in err.value.message
    assert complete(server.url, ["The capital of France is"])[0]


def test_compacted_blocks_return_to_the_pool(server, prompts):
    """Each ~900-token prompt holds 8 blocks of 128 while it is computed; LagKV at 0.75 keeps about a quarter
    of it (2 blocks): the scheduler gets the rest back after the compacting step, and the pool is empty after."""
    import re

    before = len(re.findall(r"returned (\d+) blocks", server.tail(100000)))
    complete(server.url, [s.prompt for s in prompts[:6]], {"kvtrim": "lagkv:compression_ratio=0.75"})
    freed = [int(n) for n in re.findall(r"returned (\d+) blocks", server.tail(100000))[before:]]
    assert len(freed) == 6 and all(n >= 5 for n in freed), freed
    wait_idle(server.url)


def test_aborted_request_frees_its_blocks(server, prompts):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=prompts[0].prompt, max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True,
                                                                "vllm_xargs": {"kvtrim": "keydiff:compression_ratio=0.5"}})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client goes away mid-generation: vLLM aborts the request
    wait_idle(server.url)
    assert complete(server.url, ["The capital of France is"])[0]  # and the server goes on


def test_a_count_disagreement_ends_that_request_and_the_server_goes_on(server, prompts):
    """An installed method whose kept count depends on the keys (tests/data/contract_breaker): the worker's
    count disagrees with the scheduler's at each of its requests' prompt end; those requests end with an error
    (HTTP 500, the log says why) while the requests sent with them answer, and the pool is empty after."""
    texts = [s.prompt for s in prompts[:4]]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(i):
        spec = "width_dependent:compression_ratio=0.5" if i % 2 else "keydiff:compression_ratio=0.5"
        try:
            r = client.completions.create(model=model, prompt=texts[i], max_tokens=NEW_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "vllm_xargs": {"kvtrim": spec}})
            return r.usage.completion_tokens
        except openai.InternalServerError:
            return "500"

    before = server.tail(100000).count("ended with an error: WidthDependent discarded")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    assert got == [NEW_TOKENS, "500", NEW_TOKENS, "500"], got
    assert server.tail(100000).count("ended with an error: WidthDependent discarded") - before == 2
    wait_idle(server.url)
    assert complete(server.url, ["The capital of France is"])[0]  # and the server goes on


def test_a_method_that_raises_ends_its_requests_with_an_error_its_client_sees(server, prompts):
    """An installed method whose `score` raises on the worker's keys (tests/data/contract_breaker
    `raises_in_score`), sent among four other requests: each of its requests gets an error (HTTP 500, or an
    error event when streaming), also when the token sampled in the failing step would end it (`max_tokens=1`;
    a stop string at its first token: either was a 200 with finish_reason "length"/"stop" before); the
    requests beside them get the answers they get alone, the log has the one-line reason per failed request,
    the pool is empty after and the server goes on."""
    texts = [s.prompt for s in prompts[:4]]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    good = {"ignore_eos": True, "vllm_xargs": {"kvtrim": "keydiff:compression_ratio=0.5"}}
    bad = {"vllm_xargs": {"kvtrim": "raises_in_score:compression_ratio=0.5"}}
    first = client.completions.create(model=model, prompt=prompts[4].prompt, max_tokens=1, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert first  # (a stop string matches it)
    sends = [(prompts[4 + i].prompt, kw) for i, kw in enumerate([
        dict(max_tokens=NEW_TOKENS), dict(max_tokens=1), dict(max_tokens=NEW_TOKENS, stop=[first]),
        dict(max_tokens=NEW_TOKENS, stream=True), dict(max_tokens=1, stream=True)])]

    def one(job):
        prompt, kw = job
        try:
            if kw is None:  # a good one
                return client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                                 extra_body=good).choices[0].text
            if not kw.get("stream"):
                r = client.completions.create(model=model, prompt=prompt, temperature=0, extra_body=bad, **kw)
                return ("no error", r.choices[0].text, r.choices[0].finish_reason)
            chunks = [c.choices[0] for c in client.completions.create(model=model, prompt=prompt, temperature=0,
                                                                      extra_body=bad, **kw)]
            return ("no error", "".join(c.text for c in chunks), chunks[-1].finish_reason if chunks else None)
        except openai.APIStatusError as err:
            return "error" if err.status_code >= 500 else f"status {err.status_code}"
        except openai.APIError:  # streaming: an error event after the 200 header
            return "error" if kw and kw.get("stream") else "other error"

    reason = "ended with an error: raises_in_score: the score failed on purpose"
    before = server.tail(100000).count(reason)
    jobs = [(t, None) for t in texts[:2]] + sends + [(t, None) for t in texts[2:]]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(one, jobs))
    answers = got[:2] + got[2 + len(sends):]
    assert got[2:2 + len(sends)] == ["error"] * len(sends), got
    assert server.tail(100000).count(reason) - before == len(sends)
    wait_idle(server.url)
    assert all(isinstance(a, str) and a for a in answers), answers  # the good ones beside them: answered
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # and the server goes on: the good ones again, alone
        again = list(pool.map(one, [(t, None) for t in texts]))
    # answered again (not compared with the first answers: on an AMX CPU vLLM's bfloat16 kernel gives a different
    # greedy text when the same request is batched differently)
    assert all(isinstance(a, str) and a for a in again), again


def test_200_mixed_requests_all_complete_and_nothing_leaks(server):
    """Short prompts of different lengths, methods and `full` mixed in one load (some evicting while decoding:
    20 new tokens for those; one in three compressing its first 24 tokens as a context, shared by the requests
    of the same method and first words), with bad specs among them (400s); every good request answers and the
    pool is empty afterwards, but for the blocks of the shared contexts kept."""
    specs = ["full", "lagkv:compression_ratio=0.5:lag_size=32", "keydiff:compression_ratio=0.75",
             "streaming:compression_ratio=0.5", "knorm:compression_ratio=0.5", "lagkv:compression_ratio=0.75:lag_size=16",
             "keydiff:budget=48:block_size=16", "lagkv:lag_size=8:sink_size=4", "streaming:budget=40",
             "lazyeviction:budget=40:window=4", "snapkv:budget=32:window=8:block_size=16",
             "kvzip:compression_ratio=0.5"]  # the last one: refused (scoring passes)
    decoding = {"keydiff:budget=48:block_size=16", "lagkv:lag_size=8:sink_size=4", "streaming:budget=40",
                "lazyeviction:budget=40:window=4"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex bold jugglers".split()

    def one(i):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(40 + 7 * (i % 30)))
        spec = specs[i % len(specs)]
        xargs = {"kvtrim": spec} | ({"kvtrim_context": 24} if i % 3 == 0 and spec != "full" else {})
        try:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=20 if spec in decoding else 4, temperature=0,
                                          extra_body={"ignore_eos": True, "vllm_xargs": xargs})
            return r.usage.completion_tokens
        except openai.BadRequestError:
            return "400"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(200)))
    bad = [i for i in range(200) if specs[i % len(specs)] == specs[-1]]
    assert all(got[i] == "400" for i in bad)
    assert all(got[i] == (20 if specs[i % len(specs)] in decoding else 4) for i in range(200) if i not in bad), got
    assert "starts from a shared context" in server.tail(100000)
    wait_idle(server.url, held=context_blocks(server))


def test_a_minute_of_chaos_leaves_nothing_behind(server):
    """The chaos load's short form (benchmarks/serving/chaos.py, a minute, 8 clients): every servable method,
    document questions and bursts of 8 about one document at the same moment, client aborts mid-prefill and
    mid-decode, bad specs, installed methods raising in `score`, `schedule`, `repr` and `on_attention`. Every
    response is what its request should get (a 200 with its tokens, a 400 or a 500 in one line, or the client's
    abort), and once idle, kvtrim's scheduler and worker hold no request and the same shared contexts, whose blocks
    are all the pool holds."""
    import sys

    from transformers import AutoTokenizer

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "serving"))
    import chaos

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    idle_lines = server.tail(100000).count("kvtrim: scheduler idle:")
    load = chaos.run_load(server.url, tok, seconds=60, clients=8, seed=61)
    kinds = {kind for kind, _ in load.outcomes}
    assert not load.problems, load.problems
    assert {"method", "document", "burst", "bad", "breaker"} <= kinds, load.outcomes
    wait_idle(server.url, held=context_blocks(server))
    log = server.tail(100000)
    assert log.count("kvtrim: scheduler idle:") > idle_lines
    assert not chaos.check_held(chaos.held(log)), chaos.held(log)
    assert complete(server.url, ["The capital of France is"])[0]


def recomputed_as_on_a_roomy_pool(server, samples, max_tokens: int, flags: list[str], salted: bool) -> None:
    """`samples` sent at once with KeyDiff at 0.75 (`ignore_eos`, `max_tokens` each; `salted`: each its own
    `cache_salt`) to `server` and to a 12-block server admitting as vLLM does (`flags` more): the small one
    preempts, every request still gets its `max_tokens`, and none misses a passkey that the roomy server finds."""
    spec = {"kvtrim": "keydiff:compression_ratio=0.75"}
    small = Server(method="full", extra=["--admission", "vllm", "--num-gpu-blocks-override", "12", *flags])
    try:
        def answers(url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
            model = client.models.list().data[0].id

            def one(i):
                extra = {"ignore_eos": True, "vllm_xargs": spec} | ({"cache_salt": f"restart {i}"} if salted else {})
                r = client.completions.create(model=model, prompt=samples[i].prompt, max_tokens=max_tokens,
                                              temperature=0, extra_body=extra)
                return r.choices[0].text, r.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(len(samples)) as pool:
                return list(pool.map(one, range(len(samples))))

        roomy, tight = answers(server.url), answers(small.url)
        assert gauge(small.url, "vllm:num_preemptions_total") > 0
        assert all(n == max_tokens for _, n in tight)
        found = [s.key in t[:40] for s, (t, _) in zip(samples, roomy)]
        found_tight = [s.key in t[:40] for s, (t, _) in zip(samples, tight)]
        assert sum(a and not b for a, b in zip(found, found_tight)) == 0, (roomy, tight)
        wait_idle(small.url)
    finally:
        small.stop()


def test_preempted_compacted_requests_are_recomputed(server, prompts):
    """A 12-block pool admitting as vLLM does (`--admission vllm`): four compacted requests (KeyDiff at 0.75
    keeps ~225 of ~900 entries, 2 blocks) that each grow by 200 tokens outgrow it, so vLLM preempts; a preempted request is recomputed from its tokens,
    compacted again, and answers as it does on a pool large enough for all four. Prefix caching off: with it, the
    passkey prompts share their first blocks and each admission reserves the blocks of its copies on write, so the
    four do not outgrow the pool together."""
    recomputed_as_on_a_roomy_pool(server, prompts[:4], 200, ["--max-model-len", "1280", "--no-enable-prefix-caching"],
                                  salted=False)


def test_preempted_requests_that_shared_the_cache_are_recomputed(server):
    """Prefix caching on, a 12-block pool admitting as vLLM does: two KeyDiff requests at 0.75 (~500-token prompts,
    each its own `cache_salt`, so each caches its own prompt blocks) that each grow by 880 tokens outgrow it, so
    vLLM preempts; a preempted request is recomputed (without the cache: its first compaction then keeps its
    prompt's share and all it generated, more than its spare blocks would copy), compacted again, and finds its
    passkey as it does on a pool large enough for both. Before, such a restart found its cached blocks and failed
    for want of blocks to copy them into."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    recomputed_as_on_a_roomy_pool(server, passkey_samples(tok, 500, 2, seed=31), 880, ["--max-model-len", "1408"],
                                  salted=True)


def test_a_prompt_longer_than_the_pool_is_served_in_blocks():
    """KeyDiff `budget=1024:block_size=256` on a server whose whole pool holds 2,048 tokens (16 blocks of 128)
    with `--max-model-len 8192` (plain vLLM refuses to start so: one 8,192-token request must fit; kvtrim's
    KV-cache spec reports the method's peak, 1,280 entries): a ~7,000-token passkey prompt is read in blocks
    of 256, each evicting back to 1,024 entries, and answered; a `full` request of the same prompt, which this
    pool can never hold, is refused before it runs (HTTP 400, one line; also a short chat asking for 8,000
    tokens) and the server goes on. On this prompt (seed 5,
    6,981 tokens) the engine's 12 greedy tokens were those of `kvtrim.generate(model, ids, method,
    max_new_tokens=12)` in transformers (bf16, blocks of 256): ' a mathematical formula that allows you to
    determine the color of a' (KeyDiff at this budget loses the needle; the full cache finds it), measured
    2026-12-05."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    sample = passkey_samples(tok, 7000, 1, seed=5)[0]
    n_prompt = len(tok(sample.prompt).input_ids)
    assert 6500 < n_prompt < 7500
    s = Server(method="keydiff:budget=1024:block_size=256",
               extra=["--num-gpu-blocks-override", "17", "--max-model-len", "8192"])
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=sample.prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        log = s.tail(100000)
        blocks = log.count("entries after its prompt block (KeyDiff)")
        assert r.usage.completion_tokens == NEW_TOKENS and r.usage.prompt_tokens == n_prompt
        assert blocks == -(-n_prompt // 256) - 5  # every block after the fourth (1,024 = 4 x 256) evicts ...
        assert f"keeps 1024 of {n_prompt} entries after its prompt (KeyDiff)" in log  # ... and the last one
        print(f"passkey {sample.key} {'found' if sample.key in r.choices[0].text else 'not found'}: "
              f"{r.choices[0].text!r} ({blocks} prompt-block compactions)")
        # refused by the front end before it reaches the engine: a 400 with the one line (the pool holds 16 blocks)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=model, prompt=sample.prompt, max_tokens=NEW_TOKENS, temperature=0,
                                      extra_body={"vllm_xargs": {"kvtrim": "full"}})
        assert (f"kvtrim: its prompt of {n_prompt} tokens and max_tokens={NEW_TOKENS} may take "
                f"{-(-(n_prompt + NEW_TOKENS) // 128)} KV blocks under full, more than the 16 of this server's pool"
                in refused.value.message)
        with pytest.raises(openai.BadRequestError) as refused:  # a short chat, but room for 8,000 tokens asked
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8000, extra_body={"vllm_xargs": {"kvtrim": "full"}})
        assert "max_tokens=8000 may take 63 KV blocks under full" in refused.value.message
        assert "ended with an error: its prompt" not in s.tail(100000)  # neither reached the engine
        assert client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                         temperature=0).usage.completion_tokens == 4
        wait_idle(s.url)
    finally:
        s.stop()
