"""Metrics store wire contract: queries, replies, and the JSON-lines form of one recorded event.

A client (``vllm-actors stats``, ``timeline``, ``dump``...) sends one ``MetricsQuery`` and gets one
``MetricsReply``; both are tagged msgspec Structs, msgpack on the wire (``MetricsCodec``), decoded
strictly. A store that cannot answer - a malformed query, a dump it cannot write - replies
``ErrorReply``; it never drops a query without a reply.

The JSON-lines form (``event_json_line``) is shared by the store's dump and by ``tap --json``:
one flat object per event, ``{"actor", "seq", "mono", "wall", "type", ...the event's fields}``;
``parse_event_json_line`` reads it back into the same event.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.protocol.events import Event

METRICS_PROTOCOL_VERSION = 1

# Keys the JSON-lines form puts before the event's own fields (no event has a field of that name).
RECORD_KEYS = ("actor", "seq", "mono", "wall")


# --------------------------------------------------------------------------- queries
class TimelineQuery(msgspec.Struct, tag="timeline_query", kw_only=True):
    """Every retained event of one request; with ``include_children`` a parent id also gathers
    the events of its n>1 children ``"<id>#<index>"``."""

    request_id: str
    include_children: bool = True


class SummaryQuery(msgspec.Struct, tag="summary_query", kw_only=True):
    """The whole group's summary, or (``replica``) one replica's: the events of its scheduler,
    KV-cache manager and workers alone (a replica's latencies count from its QUEUED: a client's
    ARRIVED names no replica). In a group of one replica, replica 0 is the whole group."""

    replica: int | None = None


class SeenQuery(msgspec.Struct, tag="seen_query", kw_only=True):
    """What the store has seen of one actor (or of every actor when ``actor`` is None)."""

    actor: str | None = None


class DumpQuery(msgspec.Struct, tag="dump_query", kw_only=True):
    """Write the whole retained event log as JSON lines to a new file of the store's choosing in
    the group's run directory (``DumpReply.path``); the asking side moves it where it wants it
    (``observe/tap.save_dump``). A query never names a path: whoever can reach the store's socket
    must not make it write a file where they choose (a ``path`` sent anyway is ignored)."""


class EventsQuery(msgspec.Struct, tag="events_query", kw_only=True):
    """Retained events from global index ``since_index`` on (a negative index counts from the
    end: -100 is the last 100 events), at most ``limit`` of them. For polling: pass back
    ``EventsReply.next_index``."""

    since_index: int = 0
    limit: int = 1000


MetricsQuery = TimelineQuery | SummaryQuery | SeenQuery | DumpQuery | EventsQuery

ALL_QUERIES: tuple[type[msgspec.Struct], ...] = (TimelineQuery, SummaryQuery, SeenQuery, DumpQuery, EventsQuery)


# --------------------------------------------------------------------------- reply parts
class TimelineEntry(msgspec.Struct, kw_only=True):
    """One event as recorded: who published it, its sequence number and the batch's clocks.
    In a timeline, a TOKENS event is narrowed to the one request (``request_ids == [id]``)."""

    actor: str
    seq: int
    mono: float
    wall: float
    type: str
    event: Event


class Percentiles(msgspec.Struct, kw_only=True, frozen=True):
    """``count``, ``mean`` and ``max`` cover every sample ever recorded; the percentiles cover
    the most recent samples (a bounded window). All zero while ``count`` is 0."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0


class ActorSeen(msgspec.Struct, kw_only=True):
    """The store's view of one actor's event stream and lifecycle."""

    last_seq: int = -1  # sequence number of the last event applied (-1: none yet)
    num_events: int = 0  # events applied
    num_batches: int = 0
    gaps: int = 0  # times the sequence jumped forward (or started past 0: events before the store saw it)
    missed: int = 0  # events lost in those jumps
    stale_batches: int = 0  # batches that went backwards (duplicates, late arrivals)
    stale_events: int = 0  # events of those batches that were skipped
    restarts: int = 0  # times the sequence restarted (a new incarnation of the actor)
    first_wall: float = 0.0
    last_wall: float = 0.0  # wall clock of the last batch: a liveness hint
    state: str | None = None  # last lifecycle event: STARTING, READY, DRAINING, STOPPED, CRASHED
    role: str | None = None
    pid: int | None = None
    crashes: int = 0
    error: str | None = None  # message of the last crash
    last_heartbeat_wall: float | None = None
    rejected_events: int = 0  # events a client published that clients may not publish (not applied)


# vLLM's vllm:iteration_tokens_total buckets (vllm/v1/metrics/loggers.py): tokens per engine step.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SpecDecodeCounts(msgspec.Struct, kw_only=True):
    """Speculative decoding's totals from the STEP_FINISHED events (vLLM's spec_decode counters):
    request-steps that drafted, tokens drafted, tokens accepted, and accepted by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []

    def add(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int, per_pos: list[int]) -> None:
        self.num_drafts += num_drafts
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        if len(per_pos) > len(self.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
        for position, count in enumerate(per_pos):
            self.accepted_per_pos[position] += count


class BucketCounts(msgspec.Struct, kw_only=True, frozen=True):
    """A histogram of every value seen (not a window): ``counts[i]`` values at most ``bounds[i]``
    and above the bound before it; ``counts[-1]`` those above the last bound (Prometheus' +Inf
    bucket holds ``count``)."""

    bounds: list[float] = []
    counts: list[int] = []
    count: int = 0
    total: float = 0.0


# --------------------------------------------------------------------------- replies
class TimelineReply(msgspec.Struct, tag="timeline_reply", kw_only=True):
    request_id: str
    found: bool
    events: list[TimelineEntry] = []
    dropped: int = 0  # entries left out of an over-long timeline (TOKENS, ALLOCATED, PREFILL_CHUNK first)
    state: str | None = None  # "arrived", "waiting", "running", "finished", "aborted", "lost"


class SummaryReply(msgspec.Struct, tag="summary_reply", kw_only=True):
    # the event log
    num_batches: int = 0
    num_events: int = 0  # events applied (stale duplicates not counted)
    num_retained: int = 0  # events still in the bounded history
    first_wall: float | None = None
    last_wall: float | None = None
    # requests
    requests_arrived: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    finished_by_reason: dict[str, int] = {}
    aborted_by_reason: dict[str, int] = {}
    requests_interrupted: int = 0  # waiting or running when their scheduler restarted (most then resume)
    requests_lost: int = 0  # never finished: answered with an error after an interruption, or at a group failure
    requests_evicted: int = 0  # open timelines dropped to stay within bounds (end never seen)
    running: int = 0
    waiting: int = 0
    open_requests: int = 0  # requests not yet ended (timelines kept open)
    # tokens and steps
    prompt_tokens: int = 0  # prompts of arrived requests (of finished ones when ARRIVED was missed)
    generation_tokens: int = 0  # tokens reported by TOKENS events
    prefill_tokens: int = 0  # prompt tokens computed (PREFILL_CHUNK), recomputation included
    recomputed_tokens: int = 0  # computed tokens thrown away by preemptions
    preemptions: int = 0
    prefill_chunks: int = 0
    steps: int = 0  # STEP_FINISHED events
    step_tokens: int = 0  # tokens computed by those steps
    drained_steps: int = 0  # those launched after the step in flight was read back (STEP_FINISHED.drained)
    # tokens per step as vLLM counts them (ITERATION_TOKENS_BUCKETS): sampled tokens plus the
    # computed prompts of the requests whose first token the step sampled
    step_tokens_histogram: BucketCounts = BucketCounts()
    # Prompt tokens of admitted requests by where their KV came from, at their first admission
    # (vLLM's vllm:prompt_tokens_by_source): computed, or found in the prefix cache.
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    # KV cache, summed over the KV-cache actors (from their KV_POOL events; ALLOCATED / FREED
    # when a pool state was never seen). In use: held by a request; idle cached blocks count as
    # free, as in vLLM's kv_cache_usage_perc.
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0
    kv_usage: float = 0.0
    kv_blocks_cached: int = 0  # in the prefix cache, in use or idle
    kv_blocks_evicted: int = 0  # cached blocks evicted so far (from the GPU pool, or the host tier when one is on)
    kv_blocks_offloaded: int = 0  # cached blocks moved from the GPU pool to the host tier so far
    kv_blocks_restored: int = 0  # cached blocks brought back from the host tier so far (not recomputed)
    spec_decode: SpecDecodeCounts = msgspec.field(default_factory=SpecDecodeCounts)
    # Prefix cache, in tokens (vLLM's vllm:prefix_cache_queries / _hits): tokens looked up at
    # admission, and tokens found cached and not computed.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # latencies, seconds; step execution time, milliseconds
    ttft: Percentiles = Percentiles()
    itl: Percentiles = Percentiles()
    e2e: Percentiles = Percentiles()
    queue: Percentiles = Percentiles()
    step_ms: Percentiles = Percentiles()
    # pipeline parallelism: each stage's bubble fraction, the share of the pipeline's working time
    # it was not busy ("stage 0", ...; "stage 0@1" for replica 1 of a set); empty without stages
    pipeline_bubbles: dict[str, float] = {}
    actors: dict[str, ActorSeen] = {}
    # trust: batches whose actor is not their bus topic, and events of types clients may not
    # publish that came from a client; neither is applied
    rejected_batches: int = 0
    rejected_events: int = 0
    # supervision, from the supervisor's events and the scheduler's PIPELINE_RESET
    actor_failures: dict[str, int] = {}  # ACTOR_FAILED per actor
    actor_restarts: dict[str, int] = {}  # ACTOR_RESTARTED per actor
    restart_seconds: Percentiles = Percentiles()  # ACTOR_RESTARTED.seconds: failure noticed to READY
    pipeline_resets: int = 0
    group_failed: str | None = None  # GROUP_FAILED's reason
    # sleep mode, from the scheduler's SLEEP_STATE: asleep (paused at level 0) and the level
    sleeping: bool = False
    sleep_level: int = 0
    # replica sets (data_parallel_size > 1): the replicas the store has heard from, and which one
    # this summary covers (None: the whole group, every replica summed)
    replicas: list[int] = []
    replica: int | None = None


class SeenReply(msgspec.Struct, tag="seen_reply", kw_only=True):
    actors: dict[str, ActorSeen]


class DumpReply(msgspec.Struct, tag="dump_reply", kw_only=True):
    path: str
    num_events: int


class EventsReply(msgspec.Struct, tag="events_reply", kw_only=True):
    first_index: int  # global index of events[0]
    next_index: int  # pass as since_index to get what follows
    missed: int  # events asked for that the bounded history no longer holds
    events: list[TimelineEntry]


class ErrorReply(msgspec.Struct, tag="error_reply", kw_only=True):
    message: str


MetricsReply = TimelineReply | SummaryReply | SeenReply | DumpReply | EventsReply | ErrorReply

ALL_REPLIES: tuple[type[msgspec.Struct], ...] = (
    TimelineReply, SummaryReply, SeenReply, DumpReply, EventsReply, ErrorReply,
)


class MetricsCodec:
    """msgpack encoding of queries and replies; strict decoding (raises ``msgspec.DecodeError``
    or ``msgspec.ValidationError``)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._query_decoder: msgspec.msgpack.Decoder[MetricsQuery] = msgspec.msgpack.Decoder(MetricsQuery)
        self._reply_decoder: msgspec.msgpack.Decoder[MetricsReply] = msgspec.msgpack.Decoder(MetricsReply)

    def encode(self, message: MetricsQuery | MetricsReply) -> bytes:
        return self._encoder.encode(message)

    def decode_query(self, data: bytes | memoryview) -> MetricsQuery:
        return self._query_decoder.decode(data)

    def decode_reply(self, data: bytes | memoryview) -> MetricsReply:
        return self._reply_decoder.decode(data)


# --------------------------------------------------------------------------- JSON lines
_json_encoder = msgspec.json.Encoder()


def event_record(actor: str, seq: int, mono: float, wall: float, event: Event) -> dict[str, Any]:
    """The flat dict of one recorded event: actor, seq, mono, wall, type, then the event's fields."""
    record: dict[str, Any] = {"actor": actor, "seq": seq, "mono": mono, "wall": wall}
    record.update(msgspec.to_builtins(event))  # the tag comes first, as "type"
    return record


def event_json_line(actor: str, seq: int, mono: float, wall: float, event: Event) -> str:
    """One JSON object (no trailing newline)."""
    return _json_encoder.encode(event_record(actor, seq, mono, wall, event)).decode()


def parse_event_json_line(line: str | bytes) -> tuple[str, int, float, float, Event]:
    """Inverse of ``event_json_line``: (actor, seq, mono, wall, event); raises
    ``msgspec.DecodeError`` / ``msgspec.ValidationError`` / ``KeyError`` on a malformed line."""
    record = msgspec.json.decode(line)
    if not isinstance(record, dict):
        raise msgspec.ValidationError("an event line must be a JSON object")
    actor = msgspec.convert(record.pop("actor"), str)
    seq = msgspec.convert(record.pop("seq"), int)
    mono = msgspec.convert(record.pop("mono"), float)
    wall = msgspec.convert(record.pop("wall"), float)
    event: Event = msgspec.convert(record, Event)
    return actor, seq, mono, wall, event
