"""``/metrics``: Prometheus text with vLLM's metric names, so vLLM's dashboards work unchanged.

Counters and gauges come from the metrics store's ``SummaryReply`` (the whole group's view, read
at scrape time). Latency histograms use vLLM's bucket boundaries and are observed by this server's
client as its requests progress (what its users see: arrival at the server to first token, between
tokens, to the end), plus the queue time (QUEUED to SCHEDULED) from the scheduler's events.
Every series carries a ``model_name`` label.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_actors.protocol.metrics import SummaryReply

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


class _SummaryCollector(Collector):
    """Counters and gauges from the last SummaryReply (set just before each scrape)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.summary: SummaryReply | None = None

    def collect(self) -> Iterator[Metric]:
        summary = self.summary
        if summary is None:
            return
        labels = ["model_name"]
        values = [self.model_name]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", summary.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", summary.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", summary.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (older name of vllm:kv_cache_usage_perc).",
                    summary.kv_usage)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", summary.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", summary.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", summary.preemptions)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", summary.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", summary.prefix_cache_hits)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        reasons = dict.fromkeys(("stop", "length", "abort"), 0)
        for reason, count in summary.finished_by_reason.items():
            reasons[reason] = reasons.get(reason, 0) + count
        reasons["abort"] += sum(summary.aborted_by_reason.values())
        for reason, count in reasons.items():
            success.add_metric([self.model_name, reason], count)
        yield success


class ServerMetrics:
    """The server's Prometheus registry: histograms observed live, the rest at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._summary = _SummaryCollector(model_name)
        self.registry.register(self._summary)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, documentation, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        tpot = histogram("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds (older name of inter-token latency).",
                         ITL_BUCKETS)
        e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        queue = histogram("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self._histograms: dict[str, tuple[Histogram, ...]] = {
            "ttft": (ttft,), "itl": (itl, tpot), "e2e": (e2e,), "queue": (queue,),
        }

    def observe(self, metric: str, seconds: float) -> None:
        """The client's StatsListener."""
        for histogram in self._histograms.get(metric, ()):
            histogram.observe(seconds)

    def render(self, summary: SummaryReply | None) -> bytes:
        """Prometheus text; without a summary (the store did not answer) only the histograms."""
        self._summary.summary = summary
        try:
            return generate_latest(self.registry)
        finally:
            self._summary.summary = None
