"""The request events of the bus applied to the request records, the counters and the latency samples:
a mixin of ``Recorder``, which holds the state it works on."""

from __future__ import annotations

from vllm_actors.actors.metrics_store.aggregates import Buckets, Counters, Latencies
from vllm_actors.actors.metrics_store.bounds import count_into
from vllm_actors.actors.metrics_store.records import ENDED, RequestRecord, RequestState, Stamp, elapsed, new_tokens
from vllm_actors.actors.metrics_store.request_table import TOKEN_ROW_BYTES, RequestTable
from vllm_actors.protocol.events import (
    Aborted,
    Arrived,
    Event,
    Finished,
    FirstToken,
    Preempted,
    PrefillChunk,
    Queued,
    Resumed,
    Routed,
    Scheduled,
    Tokens,
)


class RequestEvents:
    """The handlers of one request's events (ARRIVED to FINISHED or ABORTED) and of a step's TOKENS."""

    # Set by ``Recorder.__init__``.
    requests: RequestTable
    counters: Counters
    latencies: Latencies
    iteration_tokens: Buckets
    num_events: int
    _event_bytes: int
    _itl_cap: int

    def _entry(self, request_id: str, actor: str, seq: int, mono: float, wall: float, event: Event) -> RequestRecord:
        """The request's record (opened if new), with the event on its timeline."""
        record = self.requests.get(request_id)
        self.requests.add_entry(record, self.num_events, actor, seq, mono, wall, event, self._event_bytes)
        return record

    # ------------------------------------------------------------------ request events
    def _on_arrived(self, actor: str, seq: int, mono: float, wall: float, event: Arrived) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        if record.arrived is None:
            record.arrived = (actor, mono, wall)
            self.counters.requests_arrived += 1
            if not record.prompt_counted:
                record.prompt_counted = True
                self.counters.prompt_tokens += max(event.num_prompt_tokens, 0)
            record.num_prompt_tokens = max(event.num_prompt_tokens, 0)
            self._count_prompt_sources(record)
        if record.state is RequestState.NEW:
            record.state = RequestState.ARRIVED

    def _on_routed(self, actor: str, seq: int, mono: float, wall: float, event: Routed) -> None:
        self._entry(event.request_id, actor, seq, mono, wall, event)  # a replica set's routing, on the timeline

    def _on_queued(self, actor: str, seq: int, mono: float, wall: float, event: Queued) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        if record.queued is None:
            record.queued = (actor, mono, wall)
            if record.num_output_tokens is None:
                record.num_output_tokens = 0
        if not record.ended:
            self.requests.set_state(record, RequestState.WAITING, actor)

    def _on_admitted(self, actor: str, seq: int, mono: float, wall: float, event: Scheduled | Resumed) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        if isinstance(event, Scheduled) and record.scheduled is None:
            record.scheduled = (actor, mono, wall)
            record.cached_at_admission = max(event.num_cached_tokens, 0)
            self._count_prompt_sources(record)
        self.counters.prefix_cache_queries += max(event.num_query_tokens, 0)
        self.counters.prefix_cache_hits += max(event.num_cached_tokens, 0)
        if not record.ended:
            self.requests.set_state(record, RequestState.RUNNING, actor)

    def _count_prompt_sources(self, record: RequestRecord) -> None:
        sources = record.take_prompt_sources()
        if sources is not None:
            self.counters.prompt_tokens_computed += sources[0]
            self.counters.prompt_tokens_cached += sources[1]

    def _on_preempted(self, actor: str, seq: int, mono: float, wall: float, event: Preempted) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        self.counters.preemptions += 1
        self.counters.recomputed_tokens += max(event.num_computed_tokens, 0)
        if not record.ended:
            self.requests.set_state(record, RequestState.WAITING, actor)

    def _on_prefill_chunk(self, actor: str, seq: int, mono: float, wall: float, event: PrefillChunk) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        self.counters.prefill_chunks += 1
        self.counters.prefill_tokens += max(event.num_tokens, 0)
        self.requests.mark_running(record, actor)

    def _on_first_token(self, actor: str, seq: int, mono: float, wall: float, event: FirstToken) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        if record.first_token is None:
            record.first_token = (actor, mono, wall)
        self.requests.mark_running(record, actor)

    def _on_tokens(self, actor: str, seq: int, mono: float, wall: float, event: Tokens) -> None:
        # The hot path (one entry per running request per step): kept flat on purpose.
        stamp = (actor, mono, wall)
        counts = event.num_output_tokens
        num_counts = len(counts)
        requests = self.requests
        step, index, cap = event.step_id, self.num_events, requests.max_timeline_events
        if requests.full:
            requests.trim()
            if requests.full:
                cap = 0  # over the byte budget with only open records: no more TOKENS rows
        open_records, running = requests.open, RequestState.RUNNING
        generated = rows = 0
        for position, request_id in enumerate(event.request_ids):
            record = open_records.get(request_id) or requests.get(request_id)
            count = counts[position] if position < num_counts else None
            if len(record.tokens) < cap:
                record.tokens.append(index, actor, seq, mono, wall, step, -1 if count is None or count < 0 else count)
                record.nbytes += TOKEN_ROW_BYTES
                rows += 1
            else:
                record.dropped += 1
            generated += new_tokens(record, count)
            if record.state in ENDED:
                continue  # e.g. the frontend finished it on a stop string while this step ran
            if record.first_token is None and count == 1:
                record.first_token = stamp
            last = record.last_token
            if last is not None and len(record.itl) < self._itl_cap:
                seconds = mono - last[1] if last[0] == actor else wall - last[2]
                record.itl.append(seconds if seconds > 0.0 else 0.0)
            record.last_token = stamp
            if record.state is not running:
                requests.set_state(record, running, actor)
        self.counters.generation_tokens += generated
        requests.nbytes += rows * TOKEN_ROW_BYTES
        # As vLLM's iteration_tokens_total: a step's sampled tokens plus the computed prompts of the
        # requests whose first token it sampled (a step sampling nothing is not observed).
        self.iteration_tokens.add(len(event.request_ids) + max(event.num_computed_prompt_tokens, 0))

    def _on_finished(self, actor: str, seq: int, mono: float, wall: float, event: Finished) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        if record.ended:
            return
        counters = self.counters
        counters.requests_finished += 1
        count_into(counters.finished_by_reason, event.reason)
        if not record.prompt_counted:
            record.prompt_counted = True
            counters.prompt_tokens += max(event.num_prompt_tokens, 0)
        self._record_latencies(record, (actor, mono, wall))
        self.requests.end(record, RequestState.FINISHED, actor)

    def _record_latencies(self, record: RequestRecord, finished: Stamp) -> None:
        latencies = self.latencies
        start = record.arrived or record.queued
        if start is not None:
            latencies.e2e.add(elapsed(start, finished))
            if record.first_token is not None:
                latencies.ttft.add(elapsed(start, record.first_token))
        if record.queued is not None and record.scheduled is not None:
            latencies.queue.add(elapsed(record.queued, record.scheduled))
        latencies.itl.extend(record.itl)
        record.itl = []

    def _on_aborted(self, actor: str, seq: int, mono: float, wall: float, event: Aborted) -> None:
        record = self._entry(event.request_id, actor, seq, mono, wall, event)
        if record.ended:
            return
        counters = self.counters
        counters.requests_aborted += 1
        count_into(counters.aborted_by_reason, event.reason)
        if event.reason == "error" and record.interrupted and not record.lost:
            record.lost = True  # a restart took it and it could not go on
            counters.requests_lost += 1
        record.itl = []
        self.requests.end(record, RequestState.ABORTED, actor)
