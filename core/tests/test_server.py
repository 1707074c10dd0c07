"""The real server in a subprocess, serving the embedded model, driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.entrypoints.openai.launcher import ServerProcess
from engine_test_utils import unpooled_openai_client

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    # float32 with dequantized weights: the exact path, whose greedy tokens do not depend on the batch
    # (the default packed bf16 path rounds differently at different batch sizes).
    proc = ServerProcess(["--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--dtype", "float32", "--quantization", "none"])
    proc.start()
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def client(server):
    return unpooled_openai_client(f"{server.base_url}/v1")


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def health(server) -> dict:
    response = httpx.get(f"{server.base_url}/health", timeout=10)
    assert response.status_code == 200
    return response.json()


def wait_all_blocks_free(server, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        h = health(server)
        if h["num_requests_in_flight"] == 0 and h["num_free_blocks"] == h["num_total_blocks"]:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"requests or KV blocks still held: {h}")
        time.sleep(0.1)


def test_models_lists_the_embedded_model(client, server):
    models = client.models.list().data
    assert len(models) == 1
    assert "SmolLM2" in models[0].id
    assert health(server)["status"] == "ok"


def test_chat_answers_the_question(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == model


def test_streamed_chat_equals_non_streamed(client, model):
    kwargs = dict(model=model, messages=[{"role": "system", "content": "You are terse."}, *QUESTION], max_tokens=12, temperature=0)
    # the float32 path's greedy tokens do not depend on the batch: the two are sent together
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.chat.completions.create, **kwargs)
        chunks = pool.submit(lambda: list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)))
        whole, chunks = whole.result(), chunks.result()
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_accepts_text_parts_and_max_completion_tokens(client, model):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]}]
    with ThreadPoolExecutor(2) as pool:  # sent together, so that the server batches them
        parts = pool.submit(client.chat.completions.create, model=model, messages=messages, max_completion_tokens=10, temperature=0)
        plain = pool.submit(client.chat.completions.create, model=model, messages=QUESTION, max_tokens=10, temperature=0)
        parts, plain = parts.result(), plain.result()
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens <= 10


def test_completion_streamed_equals_non_streamed(client, model):
    kwargs = dict(model=model, prompt="The three primary colors are", max_tokens=10, temperature=0)
    with ThreadPoolExecutor(2) as pool:  # sent together, so that the server batches them
        whole = pool.submit(client.completions.create, **kwargs)
        chunks = pool.submit(lambda: list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)))
        whole, chunks = whole.result(), chunks.result()
    assert whole.object == "text_completion" and whole.choices[0].text
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_n2_returns_two_indexed_choices(client, model):
    with ThreadPoolExecutor(2) as pool:  # sent together, so that the server batches them
        r = pool.submit(client.completions.create, model=model, prompt="My favourite animal is", max_tokens=6, n=2, temperature=1.0, seed=7)
        chunks = pool.submit(lambda: list(
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, n=2, temperature=0.9, seed=3, stream=True)
        ))
        r, chunks = r.result(), chunks.result()
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12  # nothing stops before 6 tokens except EOS, which is rare here
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(texts.values())


def test_stop_string_cuts_the_text(client, model):
    prompt = "Count: one, two, three, four, five, six,"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = " " + words[1].strip(",.")
    assert stop in free
    with ThreadPoolExecutor(2) as pool:  # sent together, so that the server batches them
        r = pool.submit(client.completions.create, model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "zzzz"])
        streamed = pool.submit(lambda: list(
            client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=stop, stream=True)
        ))
        r, streamed = r.result(), streamed.result()
    assert r.choices[0].text == free[: free.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 3
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)  # greedy
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt="Water boils at", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(value) and token in top


def test_seed_and_engine_extras(client, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.2, seed=1234)
    # a seeded row is sampled with its own generator, so that a seed gives the same tokens in any batch; and
    # the float32 path's greedy tokens do not depend on the batch: all are sent together
    with ThreadPoolExecutor(5) as pool:
        a = pool.submit(client.completions.create, **kwargs)
        b = pool.submit(client.completions.create, **kwargs)
        greedy = pool.submit(client.completions.create, model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
        top1 = pool.submit(
            client.completions.create,
            model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, extra_body={"top_k": 1, "min_p": 0.1},
        )
        r = pool.submit(
            client.chat.completions.create,
            model=model, messages=QUESTION, max_tokens=4, temperature=0, user="u1", presence_penalty=0.5,
            frequency_penalty=0.5, logit_bias={"1": -100}, extra_body={"ignore_eos": True, "min_tokens": 4, "repetition_penalty": 1.1},
        )
        a, b, greedy, top1, r = (f.result() for f in (a, b, greedy, top1, r))
    assert a.choices[0].text == b.choices[0].text
    assert top1.choices[0].text == greedy.choices[0].text
    assert r.usage.completion_tokens == 4


def test_tokenize_detokenize_round_trip(server):
    text = "Paged attention keeps the KV cache in blocks."
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION}).json()
    assert chat["count"] > tokens["count"] - 5


def test_50_concurrent_streams_match_their_solo_output(server, model):
    prompts = ["The sun rises in the", "My name is", "def fibonacci(n):", "The best way to learn is", "Paris is a city"]

    async def stream_one(client: openai.AsyncOpenAI, prompt: str) -> str:
        text = ""
        async for chunk in await client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, stream=True):
            if chunk.choices:
                text += chunk.choices[0].text
        return text

    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        solo = [await stream_one(client, p) for p in prompts]
        together = await asyncio.gather(*(stream_one(client, prompts[i % len(prompts)]) for i in range(50)))
        await client.close()
        return solo, list(together)

    before = health(server)["peak_batch_size"]
    solo, together = asyncio.run(run())
    assert all(solo)
    for i, text in enumerate(together):
        assert text == solo[i % len(prompts)], f"client {i}"
    h = wait_all_blocks_free(server)
    assert h["peak_batch_size"] > max(before, 1)  # the clients really were batched together


def test_client_disconnect_aborts_and_frees_blocks(server, model):
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        h = health(server)
        assert h["num_requests_in_flight"] == 1 and h["num_free_blocks"] < h["num_total_blocks"]
    # the connection is closed here, long before 900 tokens
    steps = wait_all_blocks_free(server)["num_steps"]
    time.sleep(0.3)
    assert health(server)["num_steps"] == steps  # the aborted request no longer runs
    # a disconnect before any output (non-streaming) is aborted too
    try:
        httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False}, timeout=1.0)
    except httpx.TimeoutException:
        pass
    wait_all_blocks_free(server)


def test_bench_serve_against_the_server(server, capsys):
    from engine.entrypoints.cli import main

    # the warm-up request (default 1) is left out of the second run: it is not measured, and the first runs it
    for mode in (["--concurrency", "2"], ["--request-rate", "20", "--warmup", "0"]):
        args = ["bench", "serve", "--base-url", server.base_url, "--num-prompts", "4", "--input-len", "16",
                "--output-len", "4", "--json", "-", *mode]
        assert main(args) == 0
        out = capsys.readouterr().out
        metrics = json.loads(out[out.index("{"):])
        assert metrics["completed"] == 4 and metrics["failed"] == 0
        assert metrics["total_output_tokens"] == 16 and metrics["total_input_tokens"] == 64
        assert 0 < metrics["ttft_ms"]["p50"] <= metrics["e2e_latency_ms"]["p99"]
        assert metrics["output_throughput"] > 0 and "Output token throughput" in out


def test_beam_search_extension_returns_n_beams_best_first(client, model, server):
    kwargs = dict(model=model, prompt="The capital of France is", max_tokens=8)
    beams = {"use_beam_search": True, "ignore_eos": True}
    # the float32 path's tokens do not depend on the batch: the three are sent together
    with ThreadPoolExecutor(3) as pool:
        resp = pool.submit(client.completions.create, n=3, extra_body=beams, **kwargs)
        one = pool.submit(client.completions.create, n=1, extra_body=beams, **kwargs)
        greedy = pool.submit(client.completions.create, temperature=0, extra_body={"ignore_eos": True}, **kwargs)
        resp, one, greedy = resp.result(), one.result(), greedy.result()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.text for c in resp.choices]
    assert len(set(texts)) == 3
    assert resp.usage.completion_tokens == 24
    # The best beam is at least as likely as greedy: with width 1 it is greedy.
    assert one.choices[0].text == greedy.choices[0].text
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(
            model=model, prompt="x", max_tokens=4, n=2, stream=True, extra_body={"use_beam_search": True}
        )
    wait_all_blocks_free(server)


def test_engine_stats_expose_scheduler_counters(client, model, server):
    prompt = "A shared system prompt that is long enough to fill a couple of KV blocks for the cache. " * 3
    for q in ("one", "two"):
        client.completions.create(model=model, prompt=prompt + q, max_tokens=2, temperature=0)
    stats = httpx.get(f"{server.base_url}/v1/engine/stats", timeout=10).json()["scheduler"]
    for key in ("num_running", "num_waiting", "num_swapped", "kv_cache_usage", "prefix_cache_hit_rate", "num_preemptions"):
        assert key in stats
    assert stats["prefix_cache_hit_tokens"] > 0


def test_cache_salt_keeps_prefix_caches_apart(client, model, server):
    prompt = "A salted prompt, long enough to fill a few KV blocks before the question begins. " * 3 + "Why?"

    def hits_of(salt: str | None, chat: bool = False) -> tuple[str, int]:
        before = httpx.get(f"{server.base_url}/v1/engine/stats", timeout=10).json()["scheduler"]["prefix_cache_hit_tokens"]
        extra = {"cache_salt": salt} if salt is not None else {}
        if chat:
            messages = [{"role": "user", "content": prompt}]
            text = client.chat.completions.create(
                model=model, messages=messages, max_tokens=4, temperature=0, extra_body=extra
            ).choices[0].message.content
        else:
            text = client.completions.create(
                model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra
            ).choices[0].text
        after = httpx.get(f"{server.base_url}/v1/engine/stats", timeout=10).json()["scheduler"]["prefix_cache_hit_tokens"]
        return text, after - before

    first, first_hits = hits_of("tenant-a")
    other, other_hits = hits_of("tenant-b")
    plain, plain_hits = hits_of(None)
    again, again_hits = hits_of("tenant-a")
    assert first_hits == other_hits == plain_hits == 0  # nobody sees another salt's blocks
    assert again_hits > 0  # the same salt shares as before
    assert first == other == plain == again
    _, chat_hits = hits_of("tenant-c", chat=True)
    _, chat_again_hits = hits_of("tenant-c", chat=True)
    assert chat_hits == 0 and chat_again_hits > 0
    for path, body in (
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, "cache_salt": ""}),
        ("/v1/chat/completions", {"model": model, "messages": QUESTION, "max_tokens": 2, "cache_salt": ""}),
        ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2, "cache_salt": 7}),
    ):
        response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "cache_salt"
    wait_all_blocks_free(server)


# Last: it stops the module's server.
def test_sigint_finishes_in_flight_request_and_exits_0(server, model):
    received: list[str] = []

    def consume() -> None:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
            received.extend(line for line in response.iter_lines() if line.startswith("data: "))

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 30
    while health(server)["num_requests_in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stop(signal.SIGINT) == 0
    thread.join(30)
    assert received and received[-1] == "data: [DONE]"
    assert sum('"finish_reason":"length"' in line for line in received) == 1
