"""``GET /metrics``: the server's Prometheus metrics, named ``engine:*`` and labelled ``model_name``.

Each app owns a private :class:`~prometheus_client.CollectorRegistry` (several apps may share a process,
as tests do), holding:

- gauges read from :meth:`AsyncLLMEngine.stats` at scrape time: running, waiting and swapped sequences
  and the KV-cache usage (0 to 1);
- counters, the engine's own (prefix-cache queried and hit tokens, preemptions) read at scrape time too,
  and the requests' (prompt and generation tokens, finished requests by reason) counted as requests end;
- histograms of each request's timings and lengths, fed by a
  :class:`~engine.request_metrics.RequestTracker` the async engine calls on its thread.

docs/metrics.md lists every series and what it measures.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.async_engine import AsyncLLMEngine
from engine.request_metrics import ABORT, FinishedRequest, RequestTracker

#: every series' name starts with this
PREFIX = "engine:"
#: the finish reasons whose ``request_success_total`` series exist (at 0) before any request ends
KNOWN_FINISH_REASONS = ("stop", "length", ABORT)

#: seconds to the first token: from a cached short prompt on a GPU to a long queue on a CPU
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0,
)  # fmt: skip
#: seconds between two output chunks of a request: one decode step, or more under a prefill's load
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
#: seconds a whole request, its wait in the queue, its prefill or its decode took
DURATION_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
    60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0,
)  # fmt: skip


def length_buckets(max_len: int) -> tuple[float, ...]:
    """Token-count buckets: 1, 2, 5, 10, 20, 50, ... below ``max_len``, then ``max_len`` itself.

    Args:
        max_len: the longest length a request can have (the model's context).

    Returns:
        The buckets' upper bounds, ascending.
    """
    bounds: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            bound = step * scale
            if bound >= max_len:
                return (*bounds, float(max(1, max_len)))
            bounds.append(float(bound))
        scale *= 10


class _EngineStatsCollector(Collector):
    """The engine's gauges and own counters, read from its latest stats snapshot at each scrape."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        sched = stats.scheduler
        labels = [self._model_name]
        gauges = (
            (
                "num_requests_running",
                "num_running",
                "Sequences the scheduler runs (a request with n completions runs n).",
            ),
            ("num_requests_waiting", "num_waiting", "Sequences waiting to be scheduled."),
            ("num_requests_swapped", "num_swapped", "Sequences preempted to host memory."),
        )
        for name, key, doc in gauges:
            # an engine that does not report a counter gets no series rather than a false 0
            if key in sched:
                yield _gauge(name, doc, labels, float(sched[key]))
        if "kv_cache_usage" in sched:
            usage = float(sched["kv_cache_usage"])
        else:
            usage = 1.0 - stats.num_free_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
        yield _gauge(
            "kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0 to 1).", labels, usage
        )
        counters = (
            (
                "prefix_cache_queries",
                "prefix_cache_queried_tokens",
                "Prompt tokens looked up in the prefix cache.",
            ),
            ("prefix_cache_hits", "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache."),
            ("num_preemptions", "num_preemptions", "Sequences preempted since the engine started."),
            # speculative decoding, when it is on
            ("spec_decode_num_draft_tokens", "spec_num_proposed_tokens", "Speculative tokens proposed for verification."),
            ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Speculative tokens the target model accepted."),
        )
        for name, key, doc in counters:
            if key in sched:
                family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
                family.add_metric(labels, float(sched[key]))
                yield family


def _gauge(name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


class ServerMetrics:
    """One app's metrics: its registry, and the sink its engine's request tracker reports to.

    Args:
        engine: the engine whose stats the gauges read.
        model_name: the served model name, every series' ``model_name`` label.
        max_model_len: the model's context, the token-count histograms' last bucket.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine, model_name))
        #: the observer to hand the async engine (``AsyncLLMEngine.observer``)
        self.tracker = RequestTracker(self)
        reg = self.registry
        label = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, label, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, label, registry=reg, buckets=buckets)

        # the label is bound once here: observations on the engine thread skip the label lookup
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that ended.").labels(
            model_name
        )
        self._generation_tokens = counter(
            "generation_tokens", "Tokens generated by the requests that ended (every completion)."
        ).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success", "Completions ended, by finish reason (a request with n completions counts n).",
            ["model_name", "finished_reason"], registry=reg,
        )  # fmt: skip
        for reason in KNOWN_FINISH_REASONS:
            self._success.labels(model_name, reason)
        self._ttft = histogram(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
            TTFT_BUCKETS,
        ).labels(model_name)
        self._itl = histogram(
            "inter_token_latency_seconds",
            "Seconds between two outputs of a request that bring tokens (one per engine step: one token per completion).",
            ITL_BUCKETS,
        ).labels(model_name)
        self._e2e = histogram(
            "e2e_request_latency_seconds", "Seconds from a request's arrival to its end.", DURATION_BUCKETS
        ).labels(model_name)
        self._queue = histogram(
            "request_queue_time_seconds",
            "Seconds from a request's arrival until it was first scheduled.",
            DURATION_BUCKETS,
        ).labels(model_name)
        self._prefill = histogram(
            "request_prefill_time_seconds",
            "Seconds from a request's first scheduling to its first token.",
            DURATION_BUCKETS,
        ).labels(model_name)
        self._decode = histogram(
            "request_decode_time_seconds",
            "Seconds from a request's first token to its last.",
            DURATION_BUCKETS,
        ).labels(model_name)
        lengths = length_buckets(max_model_len)
        self._prompt_len = histogram("request_prompt_tokens", "Prompt tokens per request.", lengths).labels(
            model_name
        )
        self._generation_len = histogram(
            "request_generation_tokens", "Tokens generated per request (over its completions).", lengths
        ).labels(model_name)

    # ---- the tracker's sink (engine thread) ----

    def first_token(self, seconds: float) -> None:
        """See :meth:`engine.request_metrics.MetricsSink.first_token`."""
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        """See :meth:`engine.request_metrics.MetricsSink.inter_token`."""
        self._itl.observe(seconds)

    def finished(self, request: FinishedRequest) -> None:
        """See :meth:`engine.request_metrics.MetricsSink.finished`."""
        self._prompt_tokens.inc(request.num_prompt_tokens)
        self._generation_tokens.inc(request.num_generation_tokens)
        for reason in request.finish_reasons:
            self._success.labels(self.model_name, reason).inc()
        self._e2e.observe(request.e2e_time)
        self._prompt_len.observe(request.num_prompt_tokens)
        self._generation_len.observe(request.num_generation_tokens)
        for value, histogram in (
            (request.queue_time, self._queue),
            (request.prefill_time, self._prefill),
            (request.decode_time, self._decode),
        ):
            if value is not None:
                histogram.observe(value)

    # ---- scraping (event loop) ----

    def render(self) -> bytes:
        """Every series in the Prometheus text format (``prometheus_client.CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)


__all__ = ["ServerMetrics", "length_buckets"]
