"""``/metrics``: Prometheus text with vLLM 0.26's metric names, types, labels (``model_name``,
``engine``) and bucket boundaries (vllm/v1/metrics/loggers.py), so vLLM's dashboards work unchanged.

Gauges, counters and the tokens-per-step histogram come from the metrics store's ``SummaryReply``
(the whole group's view, read at scrape time: ``metrics_summary.py``). The request histograms are
observed by this server's client as its requests progress (what its users see: arrival at the
server to first token, between tokens, to the end), per engine request as in vLLM (each child of
an ``n`` > 1 request), plus the queue time (QUEUED to SCHEDULED) from the scheduler's events.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector

from vllm_actors.envs import envs
from vllm_actors.protocol.metrics import SummaryReply
from vllm_actors.server.metrics_summary import ENGINE, LABELS, SummaryCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's vllm:request_params_n
DELAY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


TOKENS = "tokens"  # buckets: build_1_2_5_buckets(max_model_len)

# The client's samples (``clients/latency.py``'s StatsListener) -> vLLM's histograms that take them:
# (name, documentation, buckets). ``inter_token_latency`` also feeds vLLM's older name.
HISTOGRAMS: dict[str, tuple[tuple[str, str, tuple[float, ...] | str], ...]] = {
    "ttft": (("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),),
    "itl": (("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds (vLLM's name "
             "before 0.11 for vllm:inter_token_latency_seconds).", ITL_BUCKETS)),
    "time_per_output_token": (("vllm:request_time_per_output_token_seconds",
                               "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),),
    "e2e": (("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             REQUEST_LATENCY_BUCKETS),),
    "queue": (("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
               REQUEST_LATENCY_BUCKETS),),
    "inference": (("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                   REQUEST_LATENCY_BUCKETS),),
    "prefill": (("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                 REQUEST_LATENCY_BUCKETS),),
    "decode": (("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                REQUEST_LATENCY_BUCKETS),),
    "prefill_kv_computed_tokens": (("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens "
                                    "computed during prefill (excluding cached tokens).", TOKENS),),
    "prompt_tokens": (("vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKENS),),
    "generation_tokens": (("vllm:request_generation_tokens", "Number of generation tokens processed.", TOKENS),),
    "max_num_generation_tokens": (("vllm:request_max_num_generation_tokens",
                                   "Histogram of maximum number of requested generation tokens.", TOKENS),),
    "params_n": (("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),),
    "params_max_tokens": (("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                           TOKENS),),
    # This engine's own (no vLLM counterpart): where a token's way to the client is spent.
    "transit": (("vllm_actors:output_transit_seconds", "Histogram of the time from a step's result leaving the "
                 "worker to its outputs reaching this server (scheduler, controller and sockets), per frame.",
                 DELAY_BUCKETS),),
    "stream_wait": (("vllm_actors:stream_wait_seconds", "Histogram of the time an output waited in this server "
                     "before its response took it (the server's event loop behind).", DELAY_BUCKETS),),
}


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def share_histograms(directory: str | Path) -> None:
    """Prometheus's multiprocess mode for this process (``--api-server-count`` above 1): every
    histogram made from now on is kept in a file of ``directory``, and each server's ``/metrics``
    sums those of all the API processes. Must come before the first ``ServerMetrics``; an API
    process calls it first thing, the serving parent once the group is up."""
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ[MULTIPROC_ENV] = str(directory)
    values.ValueClass = values.get_value_class()  # prometheus_client picks it once, at import


class ServerMetrics:
    """The server's Prometheus registry: histograms observed live, the rest at scrape time."""

    def __init__(self, model_name: str, max_model_len: int = 4096,
                 cache_config: dict[str, str] | None = None) -> None:
        """``cache_config``: ``vllm:cache_config_info``'s labels (block size, blocks, caching...).
        Under ``share_histograms`` the histograms are every API process's, summed at scrape time."""
        self.registry = CollectorRegistry()
        self._summary = SummaryCollector(model_name)
        self.registry.register(self._summary)
        shared = envs.PROMETHEUS_MULTIPROC_DIR
        own = None if shared else self.registry  # shared: the files are read instead of this process's values
        if shared:
            MultiProcessCollector(self.registry, shared)
        tokens = build_1_2_5_buckets(max_model_len)
        self._histograms: dict[str, list[Histogram]] = {}
        for metric, families in HISTOGRAMS.items():
            for name, documentation, buckets in families:
                histogram = Histogram(name, documentation, LABELS, buckets=tokens if buckets == TOKENS else buckets,
                                      registry=own)
                self._histograms.setdefault(metric, []).append(histogram.labels(model_name, ENGINE))
        if cache_config is not None:
            labels = {**cache_config, "engine": ENGINE}
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(labels),
                         registry=own, multiprocess_mode="max")
            info.labels(**labels).set(1)

    def observe(self, metric: str, seconds: float) -> None:
        """The client's StatsListener."""
        for histogram in self._histograms.get(metric, ()):
            histogram.observe(seconds)

    def render(self, summary: SummaryReply | None, per_replica: list[SummaryReply] | None = None) -> bytes:
        """Prometheus text; without a summary (the store did not answer) only the histograms. A
        replica set's families come from ``per_replica``, one series per replica (``engine``)."""
        self._summary.summary = summary
        self._summary.per_engine = list(per_replica or [])
        try:
            return generate_latest(self.registry)
        finally:
            self._summary.summary = None
            self._summary.per_engine = []
