"""Messages between the actors: the wire contract (imports nothing of the project but protocol/).

The flow of one engine step (one message per hop):

    frontend --AddRequest/AbortRequests--> scheduler
    scheduler --StepPlan--> KV-cache manager        (plan without block ids: counts only)
    KV-cache manager --StepPlan--> worker(s)        (same plan, new block ids filled in)
    worker --StepResult--> scheduler                (sampled token ids, logprobs)
    scheduler --RequestUpdates--> frontend          (new tokens, finish reasons)

The plan carries deltas only: requests entering the worker, requests leaving it, and the blocks
appended to each scheduled request's table. The worker keeps every running request's tokens,
block table and last sampled token, so a decode step needs nothing but the request id.

Every message is a tagged msgspec Struct; ``Message`` is their union, decoded strictly.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from vllm_actors.protocol.block_hash import root_hash
from vllm_actors.protocol.kv_loans import BorrowKv, LendKv, ReturnKv
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import token_id_array, unpack_token_ids

PROTOCOL_VERSION = 1


class Logprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one position: index 0 is the chosen (or actual) token, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1-based rank of each token in the distribution


class AddRequest(msgspec.Struct, tag="add_request", kw_only=True):
    request_id: str
    # The prompt: a list, or ``packed_prompt`` (``pack_token_ids``) with the list empty, as the
    # frontend sends it (a million-token list costs the scheduler 35 ms of msgpack decoding, the
    # packed form a copy). Read either with ``num_prompt_tokens`` and ``prompt_ids()``.
    prompt_token_ids: list[int] = []
    params: SamplingParams
    eos_token_ids: list[int]
    # A resubmission after the scheduler restarted: the client sends every unfinished request
    # again with the output tokens it has received, and the scheduler resumes it as after a
    # preemption (recompute). A resubmission of an id the scheduler already holds is ignored
    # (the original may still have been queued on the socket).
    resume: bool = False
    output_token_ids: list[int] = []
    # Scheduling: vLLM's priority (lower runs first; the "priority" policy orders and
    # preempts by it) and absolute deadlines in seconds on the sender's clock (arrival + the
    # request's TTFT / end-to-end target); the "edf" policy orders by the earliest of them.
    priority: int = 0
    ttft_deadline: float | None = None
    e2e_deadline: float | None = None
    # When the sender took the request (Unix seconds, the deadlines' clock): admission control's
    # "now" (the scheduler keeps no clock). None: not stamped; no deadline check at arrival.
    arrival_time: float | None = None
    # Sticky sessions (a replica set's controller): requests with the same key go to the same
    # replica. From HTTP: the ``X-Session-Id`` header, else the body's ``user`` field.
    session_key: str | None = None
    # The LoRA adapter the request runs with (None: the base model); its blocks are cached apart.
    lora_request: LoRARequest | None = None
    packed_prompt: bytes = b""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.packed_prompt) // 4 if self.packed_prompt else len(self.prompt_token_ids)

    def prompt_ids(self) -> Sequence[int]:
        """The prompt's token ids, from whichever form it came in (packed: an int32 array, made
        without a Python int per token). Only after ``prompt_form_error`` found nothing."""
        return token_id_array(self.packed_prompt) if self.packed_prompt else self.prompt_token_ids

    def prompt_form_error(self) -> str | None:
        """Why its prompt fields cannot be read (both given, or a packed length not of whole ids), or None."""
        if self.packed_prompt and self.prompt_token_ids:
            return "the prompt comes as prompt_token_ids or as packed_prompt, not both"
        if len(self.packed_prompt) % 4:
            return f"packed_prompt takes 4 bytes per token id, got {len(self.packed_prompt)} bytes"
        return None


class AbortRequests(msgspec.Struct, tag="abort_requests", kw_only=True):
    request_ids: list[str]
    # "abort" (client asked), "stop" (the detokenizer met a stop string), "disconnect", ...
    reason: str = "abort"
    # Every request the sending connection owns besides: a client that came back under the routing
    # id of one that died (an API process restarted) drops what its predecessor left running. The
    # client-facing shell expands it into ids (``owners.RequestOwners.screen``).
    all_of_sender: bool = False


class NewRequest(msgspec.Struct, kw_only=True):
    """A request entering the worker, fresh or resumed after a preemption (recompute)."""

    request_id: str
    # Every known token (the prompt, plus the outputs when resuming), packed: ``pack_token_ids``.
    # Plans admitting many long prompts would otherwise spend most of their hop in msgpack.
    token_ids: bytes
    num_prompt_tokens: int
    num_output_tokens: int  # outputs produced before a preemption (for min_tokens and seeds)
    params: SamplingParams
    eos_token_ids: list[int]
    # Leading tokens whose KV is already in cached blocks (a prefix-cache hit, whole blocks): the
    # KV-cache manager puts those blocks first in the request's table and the worker starts there.
    num_cached_tokens: int = 0
    cached_block_hash: int = 0  # the hash of the hit's last block: the KV manager walks back from it
    lora_request: LoRARequest | None = None  # its adapter: the worker loads it on first use
    # Borrowed KV (protocol/kv_loans.py): [lender replica, blocks] holding its table's front, in order.
    borrowed: list[list[int]] = []

    @property
    def root_hash(self) -> int:
        """The parent hash of its first block (its adapter's root)."""
        return root_hash(self.lora_request.lora_int_id if self.lora_request is not None else 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    def token_list(self) -> list[int]:
        return unpack_token_ids(self.token_ids)


class KvRejoin(msgspec.Struct, kw_only=True):
    """A KV-parallel rank died and was started again alone (``actors/worker/kv_rejoin.py``): every
    rank re-seeds its requests from here (its KV kept), the survivors join the new rendezvous, and
    all recompute the dead rank's share of the computed positions before the plan's step."""

    rank: int  # the KV-parallel rank that died: the K/V of its blocks is gone
    init_method: str  # the new rendezvous, where the respawned rank waits
    # Every running request: its known tokens, num_cached_tokens its computed count (no step in flight).
    requests: list[NewRequest] = []
    # Per request: positions from here on are recomputed on every rank (blocks cached for steps
    # that were lost, their tokens known; its computed count is the end of its cached blocks).
    recompute_from: list[int] = []
    block_tables: list[list[int]] = []  # filled in by the KV-cache manager: each request's whole table


class StepPlan(msgspec.Struct, tag="step_plan", kw_only=True):
    step_id: int
    # The pipeline restarts (a KV-cache manager or worker was restarted, or the scheduler is
    # new): before applying this plan the KV-cache manager and the workers drop every request,
    # block table and cached block they hold.
    reset: bool = False
    new_requests: list[NewRequest] = []
    # Requests that left the batch since the last plan (finished, aborted or preempted):
    # the KV-cache manager frees their blocks, the worker drops their state.
    finished_ids: list[str] = []
    req_ids: list[str] = []  # scheduled this step, in batch order
    num_tokens: list[int] = []  # tokens computed this step, per scheduled request
    num_blocks: list[int] = []  # KV blocks each scheduled request holds after this step
    # Prefix caching, decided by the scheduler (which knows the tokens), carried out by the
    # KV-cache manager (which knows the block ids), in this order: after freeing the departed
    # requests' blocks, uncache these blocks (by block hash); then, per scheduled request in
    # order, take its cache hit (a new request), append its blocks, and cache the blocks listed
    # for it: the hashes of the table's blocks right after its cached front, in order.
    evicted_hashes: list[int] = []
    cached_hashes: dict[str, list[int]] = {}  # request id -> hashes; only requests caching blocks
    # The host KV tier (``kv_cache_offload_gb``). Evicted blocks move to the host tier, except those
    # listed in host_dropped_hashes, which also names host blocks dropped (least recently used) to
    # make room: applied before the evictions. restored_hashes come back from the host into fresh
    # GPU blocks, cached and idle (parents first), after the evictions and before the cache hits.
    host_dropped_hashes: list[int] = []
    restored_hashes: list[int] = []
    # Speculative decoding: per drafting request, its drafted tokens (the last of its num_tokens;
    # the worker verifies them and returns the accepted ones plus one; WORKER_DRAFT (-1) entries:
    # the worker's draft model proposes them first, protocol/speculative.py).
    draft_token_ids: dict[str, list[int]] = {}
    # Blocks each listed request keeps, the rest of its table given back (they held rejected drafts
    # only): applied after the departures, before anything else of the plan.
    trimmed_blocks: dict[str, int] = {}
    # Write-through: blocks this plan caches (their KV written by its step) that are also copied to
    # the host tier after the step, staying cached on the GPU (a restarted worker resumes from them).
    backup_hashes: list[int] = []
    # With ``reset`` after a worker's restart: the host tier's blocks stay (its memory outlived the
    # worker); the GPU's backed-up blocks are then held there alone. Applied before host_dropped_hashes.
    keep_host_tier: bool = False
    # Filled in by the KV-cache manager: block ids appended to each scheduled request's table.
    new_block_ids: list[list[int]] = []
    # Filled in by the KV-cache manager: the worker copies these before the step reads its KV,
    # offloads first. Runs (``protocol.block_runs``) of (GPU block, host slot, count) and of
    # (host slot, GPU block, count).
    offload_copies: list[int] = []
    restore_copies: list[int] = []
    # Filled in by the KV-cache manager: the backups' copies, runs of (GPU block, host slot, count),
    # made once the step has written them.
    write_through_copies: list[int] = []
    # Pipeline parallelism: each decoding request's input token (the last one it sampled). Only the
    # last stage samples; the stages before it learn the token here (a request's next step is
    # planned only once its token is back, so the scheduler has it).
    input_token_ids: dict[str, int] = {}
    # Borrowed KV capacity (``protocol/kv_loans.py``), on a lender: blocks reserved this step for
    # other replicas' requests (request id -> count), and the loans that ended (their blocks free).
    # Applied after the departures, before the scheduled requests' blocks.
    loans: dict[str, int] = {}
    returned_loans: list[str] = []
    # Filled in by the KV-cache manager: the block ids of this plan's new loans (the lender's workers
    # answer the home's layers on them).
    lent_block_ids: dict[str, list[int]] = {}
    # A KV-parallel rank was restarted alone: applied first (it drops older plans as a reset does).
    kv_rejoin: KvRejoin | None = None


# ------------------------------------------------------------------ decode views
# Same wire format, decoded differently: the KV-cache manager reads a new request's id, its token
# count and its cache hit, never the sampling parameters or the EOS ids. It decodes plans as
# ``PassThroughPlan``, where those stay raw msgpack (no SamplingParams built, no validation run)
# and are re-emitted byte for byte when it forwards the plan to the workers. In one process the
# manager gets the plain ``StepPlan`` instead: it reads nothing that differs. Not in
# ``ALL_MESSAGES``: the schemas describe the wire, which these do not change.
class PassThroughNewRequest(NewRequest, kw_only=True):
    params: msgspec.Raw  # type: ignore[assignment]
    eos_token_ids: msgspec.Raw  # type: ignore[assignment]


class PassThroughPlan(StepPlan, tag="step_plan", kw_only=True):
    new_requests: list[PassThroughNewRequest] = []  # type: ignore[assignment]


class PromptLogprobs(msgspec.Struct, kw_only=True):
    request_id: str
    start: int  # prompt position of the first entry (position 0 never has one)
    entries: list[Logprobs]


class StepGpuTime(msgspec.Struct, array_like=True):
    """An earlier step's time on the GPU, measured by CUDA events (``actors/worker/gpu_timing.py``):
    a step that samples nothing is not waited for by its read-back, so its ``execute_seconds`` was 0."""

    step_id: int
    seconds: float  # from its start event to its end event
    start: float  # on the worker's wall clock (time.time()), from an event at a known time
    end: float


class StepResult(msgspec.Struct, tag="step_result", kw_only=True):
    step_id: int
    # The result of a ``reset`` plan. A new scheduler numbers its steps from 0 again, so the step
    # id alone cannot tell its reset plan's result from a result of its predecessor's plans still
    # in the pipeline: this flag does.
    reset: bool = False
    # Requests that sampled a token this step, aligned with token_ids; a request that verified
    # drafts appears once per token it gained, consecutively, in output order.
    req_ids: list[str]
    token_ids: list[int]
    logprobs: list[Logprobs | None] = []  # aligned with req_ids when any request asked for them
    prompt_logprobs: list[PromptLogprobs] = []
    num_batched_tokens: int = 0
    # Launch to read-back on the worker's clock (0: not measured; on a GPU, a step that samples
    # nothing is timed by CUDA events instead and its time comes in a later result's gpu_timings).
    execute_seconds: float = 0.0
    # The worker's wall time this step added: from the later of its launch and the previous
    # step's read-back to its own read-back (0: not measured). Unlike ``execute_seconds`` (from
    # launch, which a deferred step makes before the previous step is done) it is what a step
    # costs the throughput, whether it was deferred or read back at once.
    interval_seconds: float = 0.0
    # time.monotonic() (one clock for every process of a host) when the worker's shell sent it;
    # 0: not stamped. The scheduler passes it on in its RequestUpdates (their transit time).
    finished_at: float = 0.0
    # Speculative decoding: the requests that verified fewer drafts than their plan's WORKER_DRAFT
    # placeholders (the n-gram lookup found fewer; 0: a plain decode row), with the count they did.
    # Their planned slots are rolled back as those of rejected drafts.
    num_drafted: dict[str, int] = {}
    # Of those (drafted 0), the requests whose placeholders were dropped because their verification
    # before was still in flight (the step ran before its read-back: speculative.md), not a lookup
    # that found nothing: no acceptance observed, the step priced as a plain one.
    overlapped_ids: list[str] = []
    # Earlier steps (or this one) that reported execute_seconds 0, timed on the GPU since, in launch order.
    gpu_timings: list[StepGpuTime] = []


class RequestUpdate(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int] = []
    # Where new_token_ids[0] sits in the request's output (-1: right after what came before). A
    # replica set's controller uses it to pass each token once: after a restart of its own, a
    # replica's catch-up (the tokens its client missed) and its next updates may cross.
    output_index: int = -1
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs] | None = None
    prompt_logprobs_start: int = 0  # prompt position of prompt_logprobs[0]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id (or string) that ended the request
    num_prompt_tokens: int = 0
    # Prompt tokens served from the prefix cache at the request's first admission (vLLM's
    # usage.prompt_tokens_details.cached_tokens); sent with its first token.
    num_cached_tokens: int = 0
    error: str | None = None


def without_delivered(update: RequestUpdate, delivered: int) -> RequestUpdate:
    """The update less the tokens (and their logprobs) its receiver has already, ``delivered`` of
    them, by its ``output_index``; unpositioned updates and those starting at or past
    ``delivered`` as they are."""
    skip = delivered - update.output_index
    if update.output_index < 0 or skip <= 0:
        return update
    return msgspec.structs.replace(update, new_token_ids=update.new_token_ids[skip:], output_index=delivered,
                                   logprobs=update.logprobs[skip:] if update.logprobs else update.logprobs)


class RequestUpdates(msgspec.Struct, tag="request_updates", kw_only=True):
    step_id: int
    updates: list[RequestUpdate]
    # time.monotonic() when the step's result left the worker and when these updates left the
    # scheduler (stamped by the shells; 0: unknown): a client on the same host measures how long
    # its outputs spent on the way (vllm_actors:output_transit_seconds).
    step_finished_at: float = 0.0
    sent_at: float = 0.0


class RecoverPipeline(msgspec.Struct, tag="recover_pipeline", kw_only=True):
    """From the supervisor to the scheduler: ``actor`` (the KV-cache manager or a worker) was
    restarted and what it held is gone. The scheduler preempts every running request (they resume
    by recompute), forgets its block ledger, ignores the results of plans sent before, and marks
    its next plan ``reset``. With ``kv_rank`` (a KV-parallel rank restarted alone, waiting at
    ``rendezvous``) it keeps them instead: its next plan carries ``KvRejoin``."""

    actor: str
    reason: str
    kv_rank: int = -1
    rendezvous: str = ""


class ReplicaState(msgspec.Struct, tag="replica_state", kw_only=True):
    """From the launcher of a replica set whose replicas Ray placed (``ray_launcher``,
    runtime/ray_launch.py) to the controller: replica ``replica``'s host went down (``up`` false: its node
    or its process group is gone; its open requests go to the other replicas) or serves again
    (``up`` true: Ray restarted it; the controller reconnects to its new endpoints, read from the
    replica's attach directory, never from this message)."""

    replica: int
    up: bool
    reason: str = ""


class EngineControl(msgspec.Struct, tag="engine_control", kw_only=True):
    """A client's command to the engine (vLLM's development and profiling endpoints), answered to
    its sender alone by a ``ControlReply`` of the same ``control_id``. The scheduler answers
    ``reset_prefix_cache`` and ``is_sleeping`` itself; it passes ``sleep`` (level 1 or 2),
    ``wake_up`` and the profiler's on through the KV-cache manager to the workers, behind every
    plan sent before, and rank 0's reply comes back through it."""

    control_id: str
    action: str  # one of CONTROL_ACTIONS
    level: int = 1  # sleep: 0 pauses scheduling, 1 offloads the weights, 2 discards them; both discard the KV cache
    mode: str = "abort"  # sleep: the requests in flight are "abort"ed, "wait"ed for, or "keep" (recomputed)
    tags: list[str] | None = None  # wake_up: what wakes ("weights", "kv_cache", "scheduling"); None: all
    reset_running_requests: bool = False  # reset_prefix_cache: preempt the running requests first


CONTROL_ACTIONS = ("reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "start_profile", "stop_profile")
SLEEP_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


class ControlReply(msgspec.Struct, tag="control_reply", kw_only=True, omit_defaults=True):
    """The answer to an ``EngineControl``: ``success`` (reset_prefix_cache: false while requests
    hold blocks, as vLLM), ``is_sleeping`` (after the command), ``error`` (it was not carried out)."""

    control_id: str
    success: bool = True
    is_sleeping: bool = False
    error: str | None = None


Message = (AddRequest | AbortRequests | StepPlan | StepResult | RequestUpdates | RecoverPipeline | ReplicaState
           | EngineControl | ControlReply | LendKv | ReturnKv | BorrowKv)

ALL_MESSAGES: tuple[type[msgspec.Struct], ...] = (
    AddRequest,
    AbortRequests,
    StepPlan,
    StepResult,
    RequestUpdates,
    RecoverPipeline,
    ReplicaState,
    EngineControl,
    ControlReply,
    LendKv,
    BorrowKv,
    ReturnKv,
)
