"""GET /metrics and GET /version on a tiny random Llama, in process; the request tracker over a fake engine."""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import re

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_async_engine import FakeEngine

from engine import LLM
from engine.async_engine import AsyncLLMEngine
from engine.entrypoints.openai.metrics import length_buckets
from engine.entrypoints.openai.server import build_app, engine_version
from engine.request_metrics import FinishedRequest, RequestTracker
from engine.sampling.params import SamplingParams

MODEL = "tiny-llama"
PROMPTS = ["Hello there", "The quick brown fox jumps over", "One two three four five six seven"]
DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana" / "engine-dashboard.json"
GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc")


def tiny_engine(path: str) -> AsyncLLMEngine:
    """A fresh engine: an app's shutdown stops its engine for good, so every app gets its own."""
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=256)
    return AsyncLLMEngine(llm.llm_engine)


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir), served_model_names=[MODEL])) as c:
        yield c


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` by (name, sorted labels)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get(("engine:" + name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def grew(before: dict, after: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def test_counters_and_histograms_count_exactly_the_requests_served(client):
    before = scrape(client)
    usages = []
    for i, prompt in enumerate(PROMPTS):
        body = {"prompt": prompt, "max_tokens": 3 + i, "temperature": 0, "ignore_eos": True}
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        usages.append(reply.json()["usage"])
    after = scrape(client)
    n = len(PROMPTS)
    assert grew(before, after, "prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew(before, after, "generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert grew(before, after, "request_success_total", finished_reason="length") == n
    assert grew(before, after, "request_success_total", finished_reason="stop") == 0
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert grew(before, after, histogram + "_count") == n, histogram
    assert grew(before, after, "request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usages)
    # one inter-token observation per output chunk after the first: at most one per token after the first
    itl = grew(before, after, "inter_token_latency_seconds_count")
    assert 0 < itl <= sum(u["completion_tokens"] - 1 for u in usages)
    # the latencies are real durations: e2e covers the first token, which covers queue plus prefill
    assert (
        grew(before, after, "e2e_request_latency_seconds_sum")
        >= grew(before, after, "time_to_first_token_seconds_sum")
        > 0
    )


def test_a_streamed_request_is_counted_when_its_stream_ends(client):
    before = scrape(client)
    body = {
        "prompt": "Streaming is fun",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    after = scrape(client)
    assert grew(before, after, "prompt_tokens_total") == usage["prompt_tokens"]
    assert grew(before, after, "generation_tokens_total") == usage["completion_tokens"] == 6
    assert grew(before, after, "request_success_total", finished_reason="length") == 1
    assert grew(before, after, "time_to_first_token_seconds_count") == 1
    assert grew(before, after, "e2e_request_latency_seconds_count") == 1
    assert 0 < grew(before, after, "inter_token_latency_seconds_count") <= 5


def test_a_chat_request_counts_its_templated_prompt(client):
    before = scrape(client)
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    after = scrape(client)
    assert grew(before, after, "prompt_tokens_total") == usage["prompt_tokens"]
    assert grew(before, after, "generation_tokens_total") == usage["completion_tokens"]


def test_gauges_and_engine_counters_carry_the_model_name(client):
    samples = scrape(client)
    for gauge in GAUGES:
        assert ("engine:" + gauge, (("model_name", MODEL),)) in samples, gauge
    assert 0.0 <= value(samples, "kv_cache_usage_perc") <= 1.0
    for counter in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert ("engine:" + counter, (("model_name", MODEL),)) in samples, counter
    # every engine series, whatever its kind, is labelled with the served name
    assert all(
        dict(labels).get("model_name") == MODEL for name, labels in samples if name.startswith("engine:")
    )
    # the finish reasons a dashboard plots exist before any request ends with them
    assert ("engine:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL))) in samples


def test_the_prefix_cache_counters_follow_a_repeated_prompt(client):
    prompt = " ".join(["cache me"] * 40)
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    client.post("/v1/completions", json=body)
    before = scrape(client)
    assert client.post("/v1/completions", json=body).status_code == 200
    after = scrape(client)
    assert grew(before, after, "prefix_cache_queries_total") > 0
    assert grew(before, after, "prefix_cache_hits_total") > 0


def test_the_dashboard_plots_only_series_the_server_serves(client):
    text = DASHBOARD.read_text()
    json.loads(text)
    plotted = set(re.findall(r"engine:[a-z0-9_]+", text))
    served = {name for name, _ in scrape(client)}
    assert plotted and plotted <= served, sorted(plotted - served)


def test_version_answers_the_package_version(client):
    reply = client.get("/version")
    assert reply.status_code == 200
    assert reply.json() == {"version": engine_version()}
    assert engine_version()


def test_two_apps_in_one_process_keep_their_own_metrics(client, tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir), served_model_names=["other"])) as other:
        other.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        mine, theirs = scrape(client), scrape(other)
    assert ("engine:prompt_tokens_total", (("model_name", "other"),)) not in mine
    assert (
        theirs[("engine:request_success_total", (("finished_reason", "length"), ("model_name", "other")))]
        == 1
    )


def test_the_metrics_route_needs_the_api_key(tiny_llama_dir):
    with TestClient(build_app(tiny_engine(tiny_llama_dir), api_key="k")) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200


# ---- the tracker and the async engine's hook, over a fake engine ----


class ListSink:
    """A sink that keeps what it is told."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.done: list[FinishedRequest] = []

    def first_token(self, seconds: float) -> None:
        self.ttft.append(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.append(seconds)

    def finished(self, request: FinishedRequest) -> None:
        self.done.append(request)


def test_the_tracker_times_finished_and_aborted_requests_of_the_async_engine():
    sink = ListSink()
    tracker = RequestTracker(sink)
    engine = AsyncLLMEngine(FakeEngine(step_delay_s=0.002), observer=tracker)

    async def run() -> None:
        async for _ in engine.generate("a", [5, 6, 7], SamplingParams(max_tokens=4)):
            pass
        stream = await engine.add_request("b", [9, 9], SamplingParams(max_tokens=1000))
        await stream.__anext__()
        engine.abort("b")
        async for _ in stream:
            pass

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    done = {r.request_id: r for r in sink.done}
    a, b = done["a"], done["b"]
    assert (a.num_prompt_tokens, a.num_generation_tokens, a.finish_reasons) == (3, 4, ("length",))
    assert (b.num_prompt_tokens, b.finish_reasons) == (2, ("abort",)) and b.num_generation_tokens >= 1
    assert len(sink.ttft) == 2 and len(sink.itl) >= 3
    # the fake does not report what it runs: scheduling falls back to the step of the first output
    assert a.arrival <= a.scheduled <= a.first_token <= a.last_token <= a.finished
    assert a.e2e_time >= a.queue_time + a.prefill_time + a.decode_time - 1e-9
    assert tracker.num_tracked == 0


def test_an_observer_that_fails_is_switched_off_and_serving_goes_on():
    class Broken(ListSink):
        def first_token(self, seconds: float) -> None:
            raise RuntimeError("metrics bug")

    engine = AsyncLLMEngine(FakeEngine(), observer=RequestTracker(Broken()))

    async def run() -> list[int]:
        outs = [o async for o in engine.generate("a", [1], SamplingParams(max_tokens=3))]
        return outs[-1].outputs[0].token_ids

    try:
        assert asyncio.run(run()) == [1, 2, 3]
    finally:
        engine.shutdown()
    assert engine.observer is None


def test_length_buckets_end_at_the_context():
    assert length_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200, 256)
    assert length_buckets(1000)[-2:] == (500, 1000)
    assert length_buckets(1) == (1,)
    assert all(math.isfinite(b) for b in length_buckets(131072))
