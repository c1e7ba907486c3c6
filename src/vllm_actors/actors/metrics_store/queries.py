"""Answering queries from what the ``Recorder`` holds: summary, seen actors, one request's
timeline, a slice of the event log, and the content of a dump."""

from __future__ import annotations

import heapq
from itertools import islice

import msgspec

from vllm_actors.actors.metrics_store.aggregates import kv_gauges
from vllm_actors.actors.metrics_store.bounds import cap_id, event_bytes
from vllm_actors.actors.metrics_store.dump import DumpContent
from vllm_actors.actors.metrics_store.event_log import ROW_BYTES
from vllm_actors.actors.metrics_store.ingest import Recorder
from vllm_actors.actors.metrics_store.records import Entry, RequestRecord
from vllm_actors.protocol.events import event_type
from vllm_actors.protocol.metrics import (
    ActorSeen,
    DumpQuery,
    ErrorReply,
    EventsQuery,
    EventsReply,
    MetricsReply,
    SeenQuery,
    SeenReply,
    SummaryReply,
    TimelineEntry,
    TimelineQuery,
    TimelineReply,
)

MAX_EVENTS_PER_QUERY = 10_000
MAX_REPLY_BYTES = 8 << 20  # estimated bytes of the events one EventsQuery gets back


def summary(recorder: Recorder) -> SummaryReply:
    counters, latencies, requests = recorder.counters, recorder.latencies, recorder.requests
    kv = kv_gauges(recorder.kv.values())
    return SummaryReply(
        num_batches=recorder.num_batches,
        num_events=recorder.num_events,
        num_retained=len(recorder.history),
        first_wall=recorder.first_wall,
        last_wall=recorder.last_wall,
        requests_arrived=counters.requests_arrived,
        requests_finished=counters.requests_finished,
        requests_aborted=counters.requests_aborted,
        finished_by_reason=dict(counters.finished_by_reason),
        aborted_by_reason=dict(counters.aborted_by_reason),
        requests_interrupted=counters.requests_interrupted,
        requests_lost=counters.requests_lost,
        requests_evicted=requests.evicted,
        running=len(requests.running),
        waiting=len(requests.waiting),
        open_requests=len(requests.open),
        prompt_tokens=counters.prompt_tokens,
        generation_tokens=counters.generation_tokens,
        prefill_tokens=counters.prefill_tokens,
        recomputed_tokens=counters.recomputed_tokens,
        preemptions=counters.preemptions,
        prefill_chunks=counters.prefill_chunks,
        steps=counters.steps,
        drained_steps=counters.drained_steps,
        step_tokens=counters.step_tokens,
        step_tokens_histogram=recorder.iteration_tokens.snapshot(),
        prompt_tokens_computed=counters.prompt_tokens_computed,
        prompt_tokens_cached=counters.prompt_tokens_cached,
        kv_blocks_in_use=kv.in_use,
        kv_blocks_total=kv.total,
        kv_usage=kv.usage,
        kv_blocks_cached=kv.cached,
        kv_blocks_evicted=counters.kv_blocks_evicted,
        kv_blocks_offloaded=counters.kv_blocks_offloaded,
        kv_blocks_restored=counters.kv_blocks_restored,
        spec_decode=msgspec.structs.replace(counters.spec_decode,
                                            accepted_per_pos=list(counters.spec_decode.accepted_per_pos)),
        prefix_cache_queries=counters.prefix_cache_queries,
        prefix_cache_hits=counters.prefix_cache_hits,
        ttft=latencies.ttft.percentiles(),
        itl=latencies.itl.percentiles(),
        e2e=latencies.e2e.percentiles(),
        queue=latencies.queue.percentiles(),
        step_ms=latencies.step_ms.percentiles(),
        pipeline_bubbles=recorder.bubbles.fractions(),
        actors=_actors_copy(recorder),
        rejected_batches=counters.rejected_batches,
        rejected_events=counters.rejected_events,
        actor_failures=dict(counters.actor_failures),
        actor_restarts=dict(counters.actor_restarts),
        restart_seconds=latencies.restart.percentiles(),
        pipeline_resets=counters.pipeline_resets,
        sleeping=recorder.sleep.sleeping,
        sleep_level=recorder.sleep.level,
        group_failed=counters.group_failed,
    )


def _actors_copy(recorder: Recorder) -> dict[str, ActorSeen]:
    return {actor: msgspec.structs.replace(seen) for actor, seen in sorted(recorder.actors.items())}


def seen(recorder: Recorder, query: SeenQuery) -> MetricsReply:
    if query.actor is None:
        return SeenReply(actors=_actors_copy(recorder))
    if not isinstance(query.actor, str):
        return ErrorReply(message="SeenQuery.actor must be a string or None")
    actor = recorder.actors.get(cap_id(query.actor))
    return SeenReply(actors={} if actor is None else {query.actor: msgspec.structs.replace(actor)})


def timeline(recorder: Recorder, query: TimelineQuery) -> MetricsReply:
    request_id = query.request_id
    if not isinstance(request_id, str) or not request_id:
        return ErrorReply(message="TimelineQuery.request_id must be a non-empty string")
    request_id = cap_id(request_id)  # as the store keeps it
    own = recorder.requests.find(request_id)
    records: list[RequestRecord] = [] if own is None else [own]
    if query.include_children:
        records += recorder.requests.children_of(request_id)
    if not records:
        return TimelineReply(request_id=request_id, found=False)
    entries = sorted((entry for record in records for entry in record.all_entries()), key=lambda entry: entry[0])
    per_actor: dict[str, list[Entry]] = {}
    for entry in entries:  # one actor's entries in the order applied: its sequence order
        per_actor.setdefault(entry[1], []).append(entry)
    merged = heapq.merge(*per_actor.values(), key=lambda entry: entry[4])  # across actors: by wall
    return TimelineReply(
        request_id=request_id,
        found=True,
        events=[TimelineEntry(actor=actor, seq=seq, mono=mono, wall=wall, type=event_type(event), event=event)
                for _, actor, seq, mono, wall, event in merged],
        dropped=sum(record.dropped for record in records),
        state=own.state.value if own is not None else None,
    )


def events(recorder: Recorder, query: EventsQuery) -> MetricsReply:
    since, limit = query.since_index, query.limit
    if not isinstance(since, int) or not isinstance(limit, int) or isinstance(limit, bool):
        return ErrorReply(message="EventsQuery.since_index and limit must be integers")
    if limit < 1:
        return ErrorReply(message=f"EventsQuery.limit must be at least 1, got {limit}")
    limit = min(limit, MAX_EVENTS_PER_QUERY)
    history = recorder.history
    end = recorder.num_events
    oldest = end - len(history)
    start = max(end + since, 0) if since < 0 else min(since, end)
    missed = max(oldest - start, 0)
    start = max(start, oldest)
    found: list[TimelineEntry] = []
    size = 0
    for actor, seq, mono, wall, event in islice(history, start - oldest, start - oldest + limit):
        size += ROW_BYTES + event_bytes(event)
        if found and size > MAX_REPLY_BYTES:  # the rest in the next query (from next_index)
            break
        found.append(TimelineEntry(actor=actor, seq=seq, mono=mono, wall=wall, type=event_type(event), event=event))
    return EventsReply(first_index=start, next_index=start + len(found), missed=missed, events=found)


def dump(recorder: Recorder, query: DumpQuery) -> DumpContent:
    return DumpContent(rows=tuple(recorder.history))
