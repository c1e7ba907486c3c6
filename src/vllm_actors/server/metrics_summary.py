"""The ``/metrics`` families read from the metrics store's ``SummaryReply`` at scrape time: the
whole group's gauges, counters and the tokens-per-step histogram, under vLLM 0.26's names, types
and labels (``model_name``, ``engine``; vllm/v1/metrics/loggers.py ``PrometheusStatLogger``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from vllm_actors.protocol.metrics import BucketCounts, SpecDecodeCounts, SummaryReply

LABELS = ["model_name", "engine"]
ENGINE = "0"  # one engine (scheduler) per group: vLLM's engine index 0
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason, each a series
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def sleep_state(summary: SummaryReply) -> dict[str, float]:
    """vLLM's sleep-state series (its PrometheusStatLogger.record_sleep_state)."""
    level = summary.sleep_level if summary.sleeping else 0
    return {"awake": 0 if summary.sleeping else 1, "weights_offloaded": int(level == 1),
            "discard_all": int(level == 2)}


class SummaryCollector(Collector):
    """The families of the last ``SummaryReply`` (set just before each scrape; none without one)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.values = [model_name, ENGINE]
        self.summary: SummaryReply | None = None
        # A replica set: one summary per replica, each a series under its engine label ("0", "1", ...)
        self.per_engine: list[SummaryReply] = []

    def collect(self) -> Iterator[Metric]:
        if not self.per_engine:
            yield from self._collect_one()
            return
        merged: dict[str, Metric] = {}
        try:
            for summary in self.per_engine:
                self.summary = summary
                self.values = [self.model_name, str(summary.replica)]
                for family in self._collect_one():
                    first = merged.setdefault(family.name, family)
                    if first is not family:
                        first.samples.extend(family.samples)
        finally:
            self.values = [self.model_name, ENGINE]
        yield from merged.values()

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=LABELS)
        family.add_metric(self.values, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=LABELS)
        family.add_metric(self.values, value)
        return family

    def _labelled(self, family: GaugeMetricFamily | CounterMetricFamily,
                  values: Mapping[str, float]) -> GaugeMetricFamily | CounterMetricFamily:
        for label, value in values.items():
            family.add_metric([*self.values, label], value)
        return family

    def _collect_one(self) -> Iterator[Metric]:
        summary = self.summary
        if summary is None:
            return
        gauge, counter, labelled = self._gauge, self._counter, self._labelled
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", summary.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", summary.waiting)
        yield labelled(GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: 'capacity' "
            "= waiting for scheduling capacity; 'deferred' = deferred by transient constraints. Sum of all reasons "
            "equals vllm:num_requests_waiting.", labels=[*LABELS, "reason"]),
            {"capacity": summary.waiting, "deferred": 0})
        yield labelled(GaugeMetricFamily(
            "vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
            "engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=[*LABELS, "sleep_state"]), sleep_state(summary))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", summary.kv_usage)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's name before 0.9 for "
                    "vllm:kv_cache_usage_perc).", summary.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      summary.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      summary.prefix_cache_hits)
        # No KV connector and no multi-modal encoder cache here: vLLM serves these at 0 then too.
        yield counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                      "cross-instance cache sharing, in terms of number of queried tokens.", 0)
        yield counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                      "cross-instance cache sharing, in terms of number of cached tokens.", 0)
        yield counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.", 0)
        yield counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.", 0)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", summary.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", summary.prompt_tokens)
        yield labelled(CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", labels=[*LABELS, "source"]),
            {"local_compute": summary.prompt_tokens_computed, "local_cache_hit": summary.prompt_tokens_cached,
             "external_kv_transfer": 0})
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      summary.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", summary.generation_tokens)
        reasons = dict.fromkeys(FINISHED_REASONS, 0)
        for reason, count in summary.finished_by_reason.items():
            reasons[reason] = reasons.get(reason, 0) + count
        reasons["abort"] += sum(summary.aborted_by_reason.values())
        yield labelled(CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=[*LABELS, "finished_reason"]),
            reasons)
        yield self._histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                              summary.step_tokens_histogram)
        yield from self._spec_decode(summary.spec_decode)

    def _spec_decode(self, spec: SpecDecodeCounts) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, once a step has drafted (vLLM serves them when
        speculative decoding is configured)."""
        if not spec.num_drafts:
            return
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                            spec.num_accepted_tokens)
        yield self._labelled(CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels=[*LABELS, "position"]), {str(pos): count for pos, count in enumerate(spec.accepted_per_pos)})

    def _histogram(self, name: str, documentation: str, counts: BucketCounts) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=LABELS)
        cumulative, buckets = 0, []
        for bound, count in zip(counts.bounds, counts.counts, strict=False):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        buckets.append(("+Inf", counts.count))
        family.add_metric(self.values, buckets, counts.total)
        return family

