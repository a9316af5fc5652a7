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
    assert "kvtrim: request" not in server.tail(400)  # full compacts nothing


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
    before = server.tail(100000).count("kvtrim: request")
    evicted = complete(server.url, texts, {"kvtrim": spec})
    log = server.tail(100000)
    assert log.count("kvtrim: request") - before == len(texts)  # every request was compacted once
    found_full = [s.key in t for s, t in zip(prompts, full)]
    found = [s.key in t for s, t in zip(prompts, evicted)]
    print(f"{spec}: full found {sum(found_full)}/{len(texts)}, evicted found {sum(found)}/{len(texts)}")
    assert sum(a and not b for a, b in zip(found_full, found)) <= 1, (full, evicted)
