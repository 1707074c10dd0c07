"""The engine core in a process of its own (``engine serve --engine-core-process``): the app on a tiny random
Llama answers as the in-process engine does (greedy text and logprobs, seeded samples, stop strings, n > 1,
streaming), refusals come back as the same 400s, a client that goes away frees its KV blocks in the core,
adapter calls reach the core, and a core that dies fails its requests and reports the engine dead."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest
from fastapi.testclient import TestClient

from engine import LLM, SamplingParams
from engine.async_engine import AsyncLLMEngine
from engine.config import CacheConfig, EngineConfig
from engine.engine_core_client import EngineCoreClient
from engine.entrypoints.openai.launcher import ServerProcess
from engine.entrypoints.openai.server import build_app
from engine.errors import InvalidRequestError
from engine.request_stream import EngineDeadError

SETTINGS = {"device": "cpu", "dtype": "float32", "max_model_len": 256}
PROMPT = "Hello there, how are"


def start_core(model: str) -> EngineCoreClient:
    return EngineCoreClient.start(EngineConfig(model=model, cache=CacheConfig(kv_cache_memory_bytes=32 << 20), **SETTINGS))


@pytest.fixture(scope="module")
def core(tiny_llama_dir):
    client = start_core(tiny_llama_dir)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def app(core):
    engine = AsyncLLMEngine(core)
    with TestClient(build_app(engine)) as http:
        http.engine = engine  # type: ignore[attr-defined]
        yield http


@pytest.fixture(scope="module")
def local(tiny_llama_dir) -> LLM:
    return LLM(model=tiny_llama_dir, kv_cache_memory_bytes=32 << 20, **SETTINGS)


def model_id(app) -> str:
    return app.get("/v1/models").json()["data"][0]["id"]


def test_greedy_text_and_logprobs_are_the_in_process_engines(app, local):
    body = {"model": model_id(app), "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 2}
    choice = app.post("/v1/completions", json=body).json()["choices"][0]
    expected = local.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, logprobs=2))[0].outputs[0]
    assert choice["text"] == expected.text
    got = [lp for lp in choice["logprobs"]["token_logprobs"]]
    want = [entry[tid].logprob for tid, entry in zip(expected.token_ids, expected.logprobs)]
    assert got == pytest.approx(want, abs=1e-5)


def test_streamed_seeded_samples_with_n_and_stop_strings(app, local):
    params = {"max_tokens": 30, "temperature": 1.0, "seed": 7, "n": 2}
    expected = local.generate([PROMPT], SamplingParams(**params))[0].outputs
    # a stop string the first completion meets halfway: the text is cut there, as in process
    stop = expected[0].text[len(expected[0].text) // 2 :][:3]
    expected = local.generate([PROMPT], SamplingParams(**params, stop=[stop]))[0].outputs
    body = {"model": model_id(app), "prompt": PROMPT, "stream": True, "stop": [stop], **params}
    response = app.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    texts, reasons = ["", ""], [None, None]
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] += c["text"]
                reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    assert texts == [c.text for c in expected]
    assert reasons == [c.finish_reason for c in expected]
    assert expected[0].finish_reason == "stop"


def test_refusals_come_back_as_the_same_400s(app):
    model = model_id(app)
    too_long = app.post("/v1/completions", json={"model": model, "prompt": "hi " * 400, "max_tokens": 4})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded", too_long.text
    bad_regex = app.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4, "guided_regex": "(("})
    assert bad_regex.status_code == 400 and bad_regex.json()["error"]["param"] == "guided_regex", bad_regex.text
    # text is tokenized in the server's process: its own refusals too
    empty = app.post("/v1/completions", json={"model": model, "prompt": "", "max_tokens": 4})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt", empty.text
    ok = app.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert ok.json()["choices"][0]["finish_reason"] == "length"


def test_an_abandoned_stream_frees_its_blocks_in_the_core(app, core):
    body = {"model": model_id(app), "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with app.stream("POST", "/v1/completions", json=body) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 3:
                break  # the client hangs up mid-stream
    for _ in range(400):
        stats = app.engine.stats()
        if stats.num_requests_in_flight == 0 and core.num_free_blocks == core.num_total_blocks:
            break
        asyncio.run(asyncio.sleep(0.02))
    # the core reports its counters after the abort, though it is idle then
    assert stats.num_requests_in_flight == 0
    assert core.num_free_blocks == core.num_total_blocks
    assert core.stats()["num_running"] == 0


def test_a_request_id_in_use_is_refused_and_its_request_goes_on(app):
    engine = app.engine

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        stream = await engine.add_request("same-id", PROMPT, params)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.add_request("same-id", PROMPT, params)
        outputs = [out async for out in stream]
        return outputs[-1].outputs[0].token_ids

    assert len(asyncio.run(run())) == 8


def test_adapter_calls_reach_the_core(app):
    assert asyncio.run(app.engine.list_loras()) == []


# the engine thread ends by raising what killed it, as it does for an engine in process
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_core_that_dies_fails_its_requests_and_the_engine(tiny_llama_dir):
    client = start_core(tiny_llama_dir)
    engine = AsyncLLMEngine(client)
    deaths: list[BaseException] = []
    engine.on_dead = deaths.append

    async def run() -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = await engine.add_request("r", PROMPT, params)
        await stream.__anext__()
        client.process.kill()
        with pytest.raises(EngineDeadError, match="engine core process was killed by signal 9"):
            async for _ in stream:
                pass

    try:
        asyncio.run(run())
        # the engine thread reports its death after it failed the streams
        deadline = time.monotonic() + 30
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.01)
        assert deaths and engine.dead is not None
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--engine-core-process", "--no-engine-core-process"])
def test_engine_serve_with_the_core_in_its_own_process_or_not(tiny_llama_dir, flag):
    server = ServerProcess(["--model", tiny_llama_dir, flag, "--max-model-len", "256",
                            "--kv-cache-memory", "64MiB", "--dtype", "float32"]).start()  # fmt: skip
    try:
        import httpx

        body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
        assert reply["usage"]["completion_tokens"] == 5
        # the core's counters reach the metrics: 64 MiB of KV blocks, all free again
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        assert "num_requests_running" in metrics
        assert server.stop(signal.SIGTERM) == 0, server.log_tail()
        own_process = "engine core running in process" in server.log_tail(100_000)
        assert own_process == (flag == "--engine-core-process")
    finally:
        server.close()


def test_embeddings_cross_the_pipe_whole(tmp_path, hf_tokenizer_dir):
    """Pooling outputs are not deltas: they come once, whole, and equal sentence-transformers' vectors."""
    import torch
    from test_embeddings import save_embedding_model, st_embeddings

    texts = ["The food was delicious", "A quick brown fox"]
    model_dir = save_embedding_model(str(tmp_path / "embed"), hf_tokenizer_dir, "lasttoken", True)
    client = EngineCoreClient.start(
        EngineConfig(model=model_dir, device="cpu", dtype="float32", cache=CacheConfig(kv_cache_memory_bytes=16 << 20))
    )
    try:
        # the core's counters are there before any request, for the server's metrics
        assert client.stats()["num_running"] == 0 and client.num_free_blocks == client.num_total_blocks > 0
        with TestClient(build_app(AsyncLLMEngine(client))) as http:
            body = {"model": model_id(http), "input": texts, "encoding_format": "float"}
            data = http.post("/v1/embeddings", json=body).json()["data"]
        got = torch.tensor([d["embedding"] for d in sorted(data, key=lambda d: d["index"])])
        cosine = torch.nn.functional.cosine_similarity(got.double(), st_embeddings(model_dir, texts).double())
        assert cosine.min() >= 0.9999
    finally:
        client.shutdown()


def test_a_model_the_core_cannot_load_reads_as_in_process(tmp_path):
    from engine.parallel.mp_workers import WorkerFailed

    with pytest.raises(WorkerFailed, match=r"^model path '.*missing' does not exist"):
        EngineCoreClient.start(EngineConfig(model=str(tmp_path / "missing"), device="cpu"))


def test_the_core_reports_a_chunked_prompt_scheduled_before_its_first_token(tiny_llama_dir):
    """The metrics' queue time ends when the scheduler first runs a request: the core says so in the step
    that ran its first chunk, before any token (without it, the server would count the chunks as queueing)."""
    config = EngineConfig(model=tiny_llama_dir, cache=CacheConfig(kv_cache_memory_bytes=16 << 20),
                          scheduler={"max_num_batched_tokens": 32}, **SETTINGS)  # fmt: skip
    client = EngineCoreClient.start(config)
    try:
        client.add_request("chunked", list(range(1000, 1100)), SamplingParams(max_tokens=3, ignore_eos=True))
        outputs = []
        while "chunked" not in (client.running_ids() or set()):
            assert client.has_unfinished_requests(), "the core never said it scheduled the request"
            outputs += client.step()
        assert outputs == []  # scheduled, still prefilling its 100 tokens 32 at a time
        while not (outputs and outputs[-1].finished):
            outputs += client.step()
        assert len(outputs[-1].outputs[0].token_ids) == 3
        assert client.running_ids() == set()
    finally:
        client.shutdown()


class FailingStepEngine:
    """Just what the core's loop asks of an engine; a step with prompt [666] in it raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.requests: dict[str, list[int]] = {}
        self.num_free_blocks = self.num_total_blocks = 8

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.requests[request_id] = prompt

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        return {"num_running": len(self.requests)}

    def step(self) -> list:
        if [666] in self.requests.values():
            raise self.error
        from engine.outputs import CompletionOutput, RequestOutput

        done, self.requests = self.requests, {}
        return [RequestOutput(rid, None, p, [CompletionOutput(0, "x", [7], finish_reason="length")], finished=True)
                for rid, p in done.items()]  # fmt: skip


def run_loop(engine: FailingStepEngine, messages: list[tuple]) -> tuple[list, BaseException | None]:
    """Run a core loop on a thread over ``messages``, each sent once the core answered the one before
    (``stop`` last); returns its ``CoreStep`` replies and what it raised."""
    import multiprocessing
    import threading

    from engine.engine_core_process import EngineCoreLoop

    server, core = multiprocessing.Pipe()
    raised: list[BaseException] = []

    def target() -> None:
        try:
            EngineCoreLoop(engine, core).run()
        except BaseException as exc:
            raised.append(exc)
        finally:
            core.close()

    thread = threading.Thread(target=target)
    thread.start()
    replies = []
    for message in [*messages, ("stop", None)]:
        if not thread.is_alive():
            break
        server.send(message)
        try:
            while server.poll(0.5):  # what that message brought about
                replies.append(server.recv()[1])
        except EOFError:
            break  # the core stopped
    thread.join(30)
    return replies, raised[0] if raised else None


def test_a_failed_step_fails_its_requests_and_the_core_goes_on():
    params = SamplingParams(max_tokens=1)
    replies, raised = run_loop(FailingStepEngine(KeyError("a bug")), [
        ("add", ("bad", [666], params, {})), ("add", ("good", [5], params, {})),
    ])  # fmt: skip
    assert raised is None
    # one failed step: the core aborted the request in it at once, rather than stepping it again
    assert [r.failed for r in replies if r.failed] == ["KeyError: 'a bug'"]
    assert [d.request_id for r in replies for d in r.outputs] == ["good"]


def test_a_fatal_step_ends_the_core():
    from engine.parallel.mp_workers import WorkerFailed

    params = SamplingParams(max_tokens=1)
    _, raised = run_loop(FailingStepEngine(WorkerFailed("rank 1 exited")), [("add", ("bad", [666], params, {}))])
    assert isinstance(raised, WorkerFailed)
