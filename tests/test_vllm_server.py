"""End to end on 127.0.0.1 with the `openai` client: `kvtrim serve` (vLLM's OpenAI server + kvtrim's worker).

Run from .venv-serve (`make test` does: make serve-env, then .venv-serve/bin/python -m pytest tests/test_vllm_*.py);
skipped where vLLM or the openai client is missing. Greedy decoding, bf16 (vLLM's CPU kernels)."""

import concurrent.futures

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")
openai = pytest.importorskip("openai")

from vllm_server import Server  # noqa: E402

from kvtrim.models import resolve_model_dir  # noqa: E402
from kvtrim.passkey import passkey_samples  # noqa: E402

pytestmark = pytest.mark.integration
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    s = Server(method="full")
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


def complete(url: str, prompts: list[str], xargs: dict | None = None) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    extra = {"vllm_xargs": xargs} if xargs else {}

    def one(p):
        r = client.completions.create(model=model, prompt=p, max_tokens=NEW_TOKENS, temperature=0, extra_body=extra)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # concurrent requests: vLLM batches them
        return list(pool.map(one, prompts))


def test_full_is_plain_vllm(server, plain, prompts):
    texts = [s.prompt for s in prompts[:4]] + ["The capital of France is", "def fibonacci(n):"]
    expected = complete(plain.url, texts)
    assert complete(server.url, texts) == expected  # the server's default: full
    assert complete(server.url, texts, {"kvtrim": "full"}) == expected
    assert " prompt entries (" not in server.tail(400)  # full compacts nothing


@pytest.mark.parametrize("spec", ["nope", "lagkv", "keydiff:compression_ratio=2", "snapkv:compression_ratio=0.5",
                                  ["lagkv"]])
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
    before = server.tail(100000).count(" prompt entries (")
    evicted = complete(server.url, texts, {"kvtrim": spec})
    log = server.tail(100000)
    assert log.count(" prompt entries (") - before == len(texts)  # every request was compacted once
    found_full = [s.key in t for s, t in zip(prompts, full)]
    found = [s.key in t for s, t in zip(prompts, evicted)]
    print(f"{spec}: full found {sum(found_full)}/{len(texts)}, evicted found {sum(found)}/{len(texts)}")
    assert sum(a and not b for a, b in zip(found_full, found)) <= 1, (full, evicted)


def gauge(url: str, name: str) -> float:
    """A gauge of vLLM's Prometheus `/metrics` (summed over its label sets)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def wait_idle(url: str, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gauge(url, "vllm:num_requests_running") == 0 and gauge(url, "vllm:kv_cache_usage_perc") == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"the server kept requests or blocks: running={gauge(url, 'vllm:num_requests_running')}, "
                         f"kv usage={gauge(url, 'vllm:kv_cache_usage_perc')}")


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


def test_200_mixed_requests_all_complete_and_nothing_leaks(server):
    """Short prompts of different lengths, five methods and `full` mixed in one load, with bad specs among
    them (400s); every good request answers and the pool is empty afterwards."""
    specs = ["full", "lagkv:compression_ratio=0.5:lag_size=32", "keydiff:compression_ratio=0.75",
             "streaming:compression_ratio=0.5", "knorm:compression_ratio=0.5", "lagkv:compression_ratio=0.75:lag_size=16",
             "keydiff:budget=9"]  # the last one: refused (budget mode evicts during decoding)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    words = "the quick brown fox jumps over a lazy dog while seven wizards hex bold jugglers".split()

    def one(i):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(40 + 7 * (i % 30)))
        spec = specs[i % len(specs)]
        try:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True, "vllm_xargs": {"kvtrim": spec}})
            return r.usage.completion_tokens
        except openai.BadRequestError:
            return "400"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(200)))
    bad = [i for i in range(200) if specs[i % len(specs)] == "keydiff:budget=9"]
    assert all(got[i] == "400" for i in bad)
    assert all(got[i] == 4 for i in range(200) if i not in bad), got
    wait_idle(server.url)


def test_preempted_compacted_requests_are_recomputed(server, prompts):
    """A 12-block pool: four compacted requests (KeyDiff at 0.75 keeps ~225 of ~900 entries, 2 blocks) that
    each grow by 200 tokens outgrow it, so vLLM preempts; a preempted request is recomputed from its tokens,
    compacted again, and answers as it does on a pool large enough for all four."""
    spec = {"kvtrim": "keydiff:compression_ratio=0.75"}
    small = Server(method="full", extra=["--num-gpu-blocks-override", "12", "--max-model-len", "1280"])
    try:
        texts = [s.prompt for s in prompts[:4]]

        def long_answers(url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=900)
            model = client.models.list().data[0].id

            def one(p):
                r = client.completions.create(model=model, prompt=p, max_tokens=200, temperature=0,
                                              extra_body={"ignore_eos": True, "vllm_xargs": spec})
                return r.choices[0].text, r.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                return list(pool.map(one, texts))

        roomy, tight = long_answers(server.url), long_answers(small.url)
        assert gauge(small.url, "vllm:num_preemptions_total") > 0
        assert all(n == 200 for _, n in tight)
        found = [s.key in t[:40] for s, (t, _) in zip(prompts, roomy)]
        found_tight = [s.key in t[:40] for s, (t, _) in zip(prompts, tight)]
        assert sum(a and not b for a, b in zip(found, found_tight)) == 0, (roomy, tight)
        wait_idle(small.url)
    finally:
        small.stop()
