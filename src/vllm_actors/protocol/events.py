"""Events: every state transition of every actor, published on the bus.

State machines return events as plain Structs (no clock, no sequence number). The actor's shell
collects the events of one handling - one engine step - into a single ``EventBatch``, stamps it
with the actor id, monotonic and wall-clock time, and the per-actor sequence number of its first
event (event i of the batch has ``first_seq + i``), and publishes it with the actor id as topic.
A subscriber that sees ``first_seq`` jump past the previous batch's end has missed events: a gap.

Monotonic clocks are per host; ``mono`` orders one actor's events, ``wall`` compares actors.
"""

from __future__ import annotations

import msgspec

EVENTS_VERSION = 1


# --------------------------------------------------------------------------- request lifecycle
class Arrived(msgspec.Struct, tag="ARRIVED", kw_only=True):
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0  # the request's scheduling priority and absolute deadlines (Unix seconds)
    ttft_deadline: float | None = None
    e2e_deadline: float | None = None


class Routed(msgspec.Struct, tag="ROUTED", kw_only=True):
    """A replica set's controller sent the request to a replica (``reason``: the routing policy's
    name, "sticky", "cache_hit" or "pulled"; ``num_cached_blocks``: the prompt's blocks its
    mirror of that replica's prefix cache held)."""

    request_id: str
    replica: int
    reason: str
    num_cached_blocks: int = 0


class Queued(msgspec.Struct, tag="QUEUED", kw_only=True):
    request_id: str
    num_waiting: int
    priority: int = 0  # the request's scheduling priority and absolute deadlines (AddRequest's)
    ttft_deadline: float | None = None
    e2e_deadline: float | None = None
    lora_int_id: int = 0  # the request's LoRA adapter (0: the base model)


class Scheduled(msgspec.Struct, tag="SCHEDULED", kw_only=True):
    """First admission of a request into the running batch."""

    request_id: str
    step_id: int
    # Prefix cache lookup at admission: tokens looked up (0: no lookup, caching off or prompt
    # logprobs asked) and tokens found cached, which the request does not compute.
    num_query_tokens: int = 0
    num_cached_tokens: int = 0


class PrefillChunk(msgspec.Struct, tag="PREFILL_CHUNK", kw_only=True):
    request_id: str
    step_id: int
    start: int  # first token position computed
    num_tokens: int
    last: bool  # the chunk that completes the prefill


class FirstToken(msgspec.Struct, tag="FIRST_TOKEN", kw_only=True):
    request_id: str
    step_id: int


class Tokens(msgspec.Struct, tag="TOKENS", kw_only=True):
    """All tokens of one step, for every request that got one (batched: one event per step)."""

    step_id: int
    request_ids: list[str]
    num_output_tokens: list[int]  # each request's output length after this step
    # Prompt tokens computed (not found cached at first admission) by the requests whose first
    # token is in this step: with len(request_ids), what vLLM's iteration_tokens_total observes.
    num_computed_prompt_tokens: int = 0


class Preempted(msgspec.Struct, tag="PREEMPTED", kw_only=True):
    request_id: str
    step_id: int
    num_computed_tokens: int  # work thrown away (recomputed on resumption)


class Resumed(msgspec.Struct, tag="RESUMED", kw_only=True):
    request_id: str
    step_id: int
    num_query_tokens: int = 0  # as in SCHEDULED: a resumed request looks its tokens up again
    num_cached_tokens: int = 0


class Finished(msgspec.Struct, tag="FINISHED", kw_only=True):
    request_id: str
    reason: str  # "stop" or "length"
    num_prompt_tokens: int
    num_output_tokens: int
    stop_reason: int | str | None = None
    # Speculative decoding: tokens drafted for it and accepted (its acceptance; 0 when it did not draft).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Aborted(msgspec.Struct, tag="ABORTED", kw_only=True):
    request_id: str
    reason: str  # "abort", "disconnect", "error", "shutdown", ...
    num_output_tokens: int = 0


# --------------------------------------------------------------------------- KV cache
class Allocated(msgspec.Struct, tag="ALLOCATED", kw_only=True):
    request_id: str
    block_ids: list[int]
    num_free_blocks: int


class Freed(msgspec.Struct, tag="FREED", kw_only=True):
    request_id: str
    num_blocks: int
    num_free_blocks: int


class PrefixHit(msgspec.Struct, tag="PREFIX_HIT", kw_only=True):
    """A request entered with cached blocks at the front of its table (shared, not recomputed)."""

    request_id: str
    num_cached_tokens: int
    block_ids: list[int]
    block_hashes: list[int]  # a chain from the root: block i's parent is block i - 1


class BlockCached(msgspec.Struct, tag="BLOCK_CACHED", kw_only=True):
    """Full blocks of a request entered the prefix cache: a chain hanging under parent_hash
    (0: the root). Hashes are ``protocol.block_hash.block_hash(parent hash, token ids)``."""

    request_id: str
    parent_hash: int
    block_ids: list[int]
    block_hashes: list[int]


class BlockEvicted(msgspec.Struct, tag="BLOCK_EVICTED", kw_only=True):
    """Unreferenced cached blocks left the cache (least recently used first) to free room. With a
    host KV tier, blocks leaving the GPU pool move to the host (BLOCK_OFFLOADED) and stay cached;
    they leave the cache when the host tier drops them (``tier`` "host", ``block_ids`` its slots)."""

    block_ids: list[int]
    block_hashes: list[int]
    parent_hashes: list[int]
    tier: str = "gpu"  # "gpu" or "host": where the blocks were


class BlockOffloaded(msgspec.Struct, tag="BLOCK_OFFLOADED", kw_only=True):
    """Cached blocks left the GPU pool for the host tier (still cached there). ``copies``: runs of
    (GPU block, host slot, count), ``protocol.block_runs``. ``write_through``: copies of blocks
    just computed, which stay cached on the GPU too (a restarted worker resumes from them)."""

    copies: list[int]
    num_blocks: int
    num_host_cached: int  # host slots in use after the move
    num_host_blocks: int
    write_through: bool = False


class BlockRestored(msgspec.Struct, tag="BLOCK_RESTORED", kw_only=True):
    """Cached blocks came back from the host tier into the GPU pool (a prefix hit on them) instead
    of being recomputed. ``copies``: runs of (host slot, GPU block, count)."""

    copies: list[int]
    num_blocks: int
    num_host_cached: int
    num_host_blocks: int


class KvPool(msgspec.Struct, tag="KV_POOL", kw_only=True):
    """The pool's counts after a step's changes: free + cached + private == total, where cached
    blocks are either in use (held by a request) or idle (evictable)."""

    num_blocks: int
    num_free: int
    num_cached: int
    num_cached_idle: int
    num_in_use: int  # blocks held by at least one request (private or cached)


class KvLent(msgspec.Struct, tag="KV_LENT", kw_only=True):
    """A lender's KV-cache manager reserved blocks of its pool for another replica's request
    (borrowed KV capacity across a data-parallel set; the ``ROUTED`` event names its home)."""

    request_id: str
    block_ids: list[int]
    num_free_blocks: int


class KvReturned(msgspec.Struct, tag="KV_RETURNED", kw_only=True):
    """A loan ended: the blocks reserved for another replica's request are free again."""

    request_id: str
    num_blocks: int
    num_free_blocks: int


# --------------------------------------------------------------------------- worker
class StepStarted(msgspec.Struct, tag="STEP_STARTED", kw_only=True):
    step_id: int
    num_seqs: int
    num_tokens: int
    num_prefill_seqs: int


class StepFinished(msgspec.Struct, tag="STEP_FINISHED", kw_only=True):
    step_id: int
    num_seqs: int
    num_tokens: int
    num_sampled: int
    # Forward pass and sampling, as timed by the worker's host: launch to read-back. A step that
    # samples nothing on a GPU is not waited for (its launch time only): STEP_TIMED has its GPU time.
    execute_ms: float
    # A pipeline stage before the last: its part of the step (its layers; the step is counted once,
    # by the last stage's event, which has None). The step id is the micro-batch's.
    stage: int | None = None
    # The step in flight was read back before this one launched (drafts to verify, logprobs, a
    # reset), so the device idled while this one was prepared: what a speculating engine gives up.
    drained: bool = False
    # Requests whose decode row was launched before the drafting step they verified drafts in was
    # read back, its position and input moved on the device by their accepted count (speculative.md).
    overlapped: int = 0
    # Speculative decoding: requests that verified drafts, their drafted tokens, those accepted,
    # and the accepted ones by draft position (vLLM's spec_decode counters).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []


class StepTimed(msgspec.Struct, tag="STEP_TIMED", kw_only=True):
    """A step that sampled nothing (a prefill chunk short of its prompt's end, a pipeline stage
    before the last), timed on the GPU by CUDA events and published once they completed (with a
    later step's events, or when the worker looks in between): its busy time on that stage's
    device and when it started and ended there, on the worker's wall clock (Unix seconds)."""

    step_id: int
    stage: int | None = None  # as STEP_FINISHED's: None on the last stage
    gpu_ms: float
    gpu_start: float
    gpu_end: float


# --------------------------------------------------------------------------- actor lifecycle
class ActorStarting(msgspec.Struct, tag="STARTING", kw_only=True):
    pid: int
    role: str


class ActorReady(msgspec.Struct, tag="READY", kw_only=True):
    pid: int
    role: str


class ActorDraining(msgspec.Struct, tag="DRAINING", kw_only=True):
    reason: str


class ActorStopped(msgspec.Struct, tag="STOPPED", kw_only=True):
    reason: str


class ActorCrashed(msgspec.Struct, tag="CRASHED", kw_only=True):
    error: str


class Heartbeat(msgspec.Struct, tag="HEARTBEAT", kw_only=True):
    pid: int


class Rejected(msgspec.Struct, tag="REJECTED", kw_only=True):
    """The actor rejected a message that failed validation (nothing changed; it keeps serving)."""

    message_type: str
    sender: str  # the sender's identity, as text
    error: str


class ActorFailed(msgspec.Struct, tag="ACTOR_FAILED", kw_only=True):
    """Published by the supervisor: a child exited or stopped answering (``how``: "exited" or
    "hung"); ``detail`` gives the exit code or signal, or how long it was silent. ``how`` "unit":
    a tensor-parallel rank taken down because another rank failed (``detail`` names it)."""

    actor: str
    how: str
    detail: str


class ActorRestarted(msgspec.Struct, tag="ACTOR_RESTARTED", kw_only=True):
    """Published by the supervisor once a restarted child is READY again."""

    actor: str
    pid: int
    attempt: int  # restarts of this actor so far, this one included
    seconds: float  # from noticing the failure to READY


class GroupFailed(msgspec.Struct, tag="GROUP_FAILED", kw_only=True):
    """Published by the supervisor when it gives up (restart budget spent, a child that cannot
    start again): every open request ends with an error and the group shuts down."""

    reason: str


class PipelineReset(msgspec.Struct, tag="PIPELINE_RESET", kw_only=True):
    """Published by the scheduler when it resets the step pipeline after a restart: how many
    running requests it preempted to resume by recompute."""

    reason: str
    num_preempted: int


class KvShareRecovered(msgspec.Struct, tag="KV_SHARE_RECOVERED", kw_only=True):
    """Published by the answering worker when the KV-parallel ranks recomputed a dead rank's share
    of the running requests (it was restarted alone): how many positions that took, of how many
    computed ones (the rest survived on the other ranks)."""

    step_id: int
    rank: int  # the KV-parallel rank that died
    num_requests: int
    num_recomputed_tokens: int
    num_computed_tokens: int


class SleepChanged(msgspec.Struct, tag="SLEEP_STATE", kw_only=True):
    """Published by the scheduler when the engine falls asleep or wakes up (vLLM's sleep mode):
    ``level`` 0 pauses scheduling only, 1 offloads the weights, 2 discards them; awake: not sleeping."""

    sleeping: bool
    level: int = 0


Event = (
    Arrived | Routed | Queued | Scheduled | PrefillChunk | FirstToken | Tokens | Preempted | Resumed
    | Finished | Aborted | Allocated | Freed | PrefixHit | BlockCached | BlockEvicted | BlockOffloaded | BlockRestored
    | KvPool | KvLent | KvReturned
    | StepStarted | StepFinished | StepTimed
    | ActorStarting | ActorReady | ActorDraining | ActorStopped | ActorCrashed | Heartbeat | Rejected
    | ActorFailed | ActorRestarted | GroupFailed | PipelineReset | KvShareRecovered | SleepChanged
)

ALL_EVENTS: tuple[type[msgspec.Struct], ...] = (
    Arrived, Routed, Queued, Scheduled, PrefillChunk, FirstToken, Tokens, Preempted, Resumed, Finished,
    Aborted, Allocated, Freed, PrefixHit, BlockCached, BlockEvicted, BlockOffloaded, BlockRestored, KvPool,
    KvLent, KvReturned, StepStarted, StepFinished, StepTimed,
    ActorStarting, ActorReady, ActorDraining, ActorStopped, ActorCrashed, Heartbeat, Rejected,
    ActorFailed, ActorRestarted, GroupFailed, PipelineReset, KvShareRecovered, SleepChanged,
)

# What an engine actor reports about its work (requests, KV blocks, steps), as opposed to the
# lifecycle and supervision events. The engine argument disable_events (deprecated alias:
# VLLM_ACTORS_DISABLE_EVENTS=1) drops these before they are published, to measure what publishing
# them costs (the metrics store then sees no requests).
WORK_EVENTS: tuple[type[msgspec.Struct], ...] = (
    Arrived, Routed, Queued, Scheduled, PrefillChunk, FirstToken, Tokens, Preempted, Resumed, Finished,
    Aborted, Allocated, Freed, PrefixHit, BlockCached, BlockEvicted, BlockOffloaded, BlockRestored, KvPool,
    KvLent, KvReturned, StepStarted, StepFinished, StepTimed,
)
DISABLE_EVENTS_ENV = "VLLM_ACTORS_DISABLE_EVENTS"  # the deprecated alias's name (benchmarks set it)

REQUEST_EVENTS = ("ARRIVED", "ROUTED", "QUEUED", "SCHEDULED", "PREFILL_CHUNK", "FIRST_TOKEN", "TOKENS",
                  "PREEMPTED", "RESUMED", "FINISHED", "ABORTED")


def event_type(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


class EventBatch(msgspec.Struct, tag="event_batch", kw_only=True):
    # actor id, e.g. "scheduler" or "worker-0"; also the bus topic. A replica's actors carry their
    # replica ("scheduler@1", "worker-0@1": ``names.replica_of``), which the bus vouches for.
    actor: str
    first_seq: int  # per-actor sequence number of events[0]; events[i] has first_seq + i
    mono: float  # time.monotonic() of the publishing host when the batch was stamped
    wall: float  # time.time()
    events: list[Event]


def stamped(batch: EventBatch) -> list[tuple[int, Event]]:
    """(sequence number, event) pairs of a batch."""
    return [(batch.first_seq + index, event) for index, event in enumerate(batch.events)]
