"""`kvtrim serve` past one worker, on 127.0.0.1 with the `openai` client: tensor parallelism (each rank compacts
its own KV heads with the counts the one scheduler decided) and data parallelism (kvtrim in every engine), on a
tiny random Llama with 4 KV heads and 8 query heads (SmolLM2's 9 query heads do not split in two), float32,
greedy, against the same model served by one worker. Run from .venv-serve."""

import concurrent.futures
import os

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build (.venv-serve: make serve-env)")
openai = pytest.importorskip("openai")

from test_vllm_server import CONTRACT_BREAKER, context_blocks, wait_idle  # noqa: E402
from vllm_server import Server  # noqa: E402

pytestmark = pytest.mark.integration

#: the methods kvtrim's engine runs under tensor parallelism (TOVA decides across heads: refused there)
SPECS = ["keydiff:compression_ratio=0.5", "keydiff:budget=128:block_size=64", "lagkv:compression_ratio=0.5",
         "lagkv:keep_ratio=0.25:lag_size=32", "streaming:budget=128", "knorm:compression_ratio=0.5",
         "snapkv:compression_ratio=0.5", "h2o:budget=128", "lazyeviction:budget=192:window=32"]
FLAGS = ["--dtype", "float32", "--max-model-len", "2048", "--num-gpu-blocks-override", "64"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random Llama (4 layers, 4 KV heads, 8 query heads of 32) with SmolLM2's tokenizer, saved as a model
    folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvtrim.models import resolve_model_dir

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def serve(model, flags, bind="nobind"):
    # (with the test plugin of methods that break the engine's contract on the server's PYTHONPATH)
    path = os.pathsep.join(filter(None, [CONTRACT_BREAKER, os.environ.get("PYTHONPATH")]))
    return Server(model=model, method="full", extra=[*FLAGS, *flags],
                  env_extra={"VLLM_CPU_OMP_THREADS_BIND": bind, "PYTHONPATH": path})


@pytest.fixture(scope="module")
def one(tiny_model):
    s = serve(tiny_model, [])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tp2(tiny_model):
    s = serve(tiny_model, ["--tensor-parallel-size", "2"], bind="0|1")  # one core per rank (one NUMA node here)
    yield s
    s.stop()


def prompts(n: int = 2, length: int = 600) -> list[list[int]]:
    return [[(i * 7919 + 13 * k) % 40000 + 100 for i in range(length)] for k in range(n)]


def answers(url: str, specs: list[str], max_tokens: int = 24, xargs: dict | None = None) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def ask(job):
        spec, k, ids = job
        r = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True, "vllm_xargs": {"kvtrim": spec, **(xargs or {})}})
        return (spec, k), r.choices[0].text

    jobs = [(spec, k, ids) for spec in specs for k, ids in enumerate(prompts())]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return dict(pool.map(ask, jobs))


def test_tensor_parallel_ranks_answer_as_one_worker(one, tp2):
    """Float32, greedy: every method the engine runs under tensor parallelism answers at TP 2 as on one worker,
    token for token (each rank compacts its 2 KV heads by the scheduler's counts), and so does a shared context."""
    specs = ["full", *SPECS]
    assert answers(tp2.url, specs) == answers(one.url, specs)
    context = {"kvtrim_context": 500}
    for _ in range(2):  # the second time: started from the shared compressed context
        assert answers(tp2.url, SPECS[:1], xargs=context) == answers(one.url, SPECS[:1], xargs=context)
    assert "starts from a shared context" in tp2.tail(100000)
    wait_idle(tp2.url, held=context_blocks(tp2), pool=63)


def test_a_method_deciding_across_heads_is_a_400_under_tensor_parallelism(one, tp2):
    client = openai.OpenAI(base_url=tp2.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match=r"TOVA decides from all of a layer's heads at once.*--tensor-parallel-size 1"):
        client.completions.create(model=model, prompt=prompts(1)[0], max_tokens=4,
                                  extra_body={"vllm_xargs": {"kvtrim": "tova:budget=64"}})
    assert answers(one.url, ["tova:budget=128"])  # (served by one worker)


def test_a_compaction_failing_on_one_rank_only_ends_its_request_and_the_server_goes_on(tp2, one):
    """A method raising on tensor-parallel rank 1 only (tests/data/contract_breaker `raises_on_rank_one`): vLLM hands
    the scheduler rank 0's output, yet the request ends with an error its client sees (the ranks gather their
    failures), and the server goes on answering as one worker."""
    client = openai.OpenAI(base_url=tp2.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model=model, prompt=prompts(1)[0], max_tokens=8, temperature=0,
                                  extra_body={"vllm_xargs": {"kvtrim": "raises_on_rank_one:compression_ratio=0.5"}})
    assert "the score failed on purpose (on tensor-parallel rank 1)" in tp2.tail(100000)
    assert answers(tp2.url, SPECS[:2]) == answers(one.url, SPECS[:2])
    wait_idle(tp2.url, held=context_blocks(tp2), pool=63)


def test_a_mixed_load_and_an_abort_at_tensor_parallel_2_leave_the_pool_empty(tp2, one):
    """40 requests of every method (some with a context), all answered; then a request aborted mid-decode (its
    stream closed): every rank drops it, the pool is empty but for the shared contexts, and the server answers
    as one worker afterwards."""
    client = openai.OpenAI(base_url=tp2.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def ask(i):
        spec = SPECS[i % len(SPECS)]
        ids = prompts(1, 200 + 23 * (i % 17))[0]
        xargs = {"kvtrim": spec} | ({"kvtrim_context": 150} if i % 4 == 0 else {})
        r = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "vllm_xargs": xargs})
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(40))) == [16] * 40
    stream = client.completions.create(model=model, prompt=prompts(1)[0], max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "vllm_xargs": {"kvtrim": "lazyeviction:budget=192:window=32"}})
    for i, _ in enumerate(stream):
        if i == 40:
            break
    stream.close()
    wait_idle(tp2.url, held=context_blocks(tp2), pool=63)
    assert answers(tp2.url, SPECS[-2:]) == answers(one.url, SPECS[-2:])


def test_data_parallel_engines_each_run_kvtrim(one, tiny_model):
    """`--data-parallel-size 2`: two engines, each with kvtrim's scheduler and worker (requests go to both), answer
    as one worker for every method, TOVA included (each engine holds every head)."""
    dp2 = serve(tiny_model, ["--data-parallel-size", "2"], bind="0|1")
    try:
        specs = [*SPECS[:4], "tova:budget=128"]
        assert answers(dp2.url, specs) == answers(one.url, specs)
        lines = dp2.tail(100000).splitlines()
        for engine in ("EngineCore_DP0", "EngineCore_DP1"):  # each engine's kvtrim scheduler freed compacted blocks
            assert any(engine in line and "returned" in line and "blocks to the pool" in line for line in lines)
        wait_idle(dp2.url, pool=63)
    finally:
        dp2.stop()
