"""How many prompt tokens each prefill gets in one planning pass, so that a long prompt proceeds
without taking its neighbours' latency:

- ``long_prefill_token_threshold`` (vLLM's): a prefill gets at most that many tokens a step, and a
  prompt with more tokens left than that is *long*;
- ``max_num_partial_prefills`` / ``max_long_partial_prefills`` (vLLM's concurrent partial
  prefills, on when the first is above 1): at most that many prefills in a step, at most that many
  of them long (a long waiting prompt is passed over, the shorter ones behind it are admitted);
- ``itl_target`` (seconds; Medha's adaptive chunking): while decodes run, the step's prefill
  tokens are sized by the step cost model so the step's predicted time, their decode step, stays
  within the target (aimed below it by how far recent such steps ran past their prediction: the target
  is a 99th percentile's, ``cost_model.Overruns``). The chunk shrinks as a long prompt's context grows
  (its attention terms, the pairs and the scan of its context: ``chunk_pairs``, ``chunk_scan``; the model
  learns each step's wall share), grows at most ``MAX_CHUNK_GROWTH`` times over the request's last
  (beyond the chunks it was fitted on the model is not to be trusted), and at most in proportion to the
  room left by the step's other work over what its latest measured chunk took (``note_chunk_times``: the
  model's fit can lag a chunk's cost by several steps, and a chunk's cost is affine in its size at one
  context, so the proportion grows safely and shrinks to the target in a few steps). The step's first prefill gets at
  least ``MIN_CHUNK`` tokens whatever the prediction, so a long prompt always moves; the others get nothing
  once the target is spent, or below ``MIN_SIDE_CHUNK`` (a chunk's scan of its context costs whatever its
  size);
- under pipeline parallelism (``pipeline_parallel_size`` above 1, chunked prefill on), a prompt's
  chunks take equal predicted times within the budget (``spp_chunks``): larger early, smaller late,
  as many as the model predicts fastest through the stages;
- a request on borrowed KV (a guest of a replica set's lenders) is never shrunk for the target (``GUEST``).

One ``PrefillSizer`` per planning pass; the scheduler asks it before giving a request tokens."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from vllm_actors.actors.scheduler.cost_model import CostModel, StepFeatures, chunk_pairs, chunk_scan
from vllm_actors.actors.scheduler.deadlines import step_features, step_wall_seconds
from vllm_actors.actors.scheduler.late_timings import read_back_with_previous
from vllm_actors.actors.scheduler.policies.base import QueuePolicy
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.actors.scheduler.spp_chunks import CHUNK_ALIGN, balanced_chunk
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.messages import StepPlan, StepResult

# Tokens the step's first prefill gets even when the decodes alone fill the target (it always moves): flash-attn's
# split over the keys takes chunks from 64 (``prefill_choice.SPLIT_MIN_QUERY_LEN``). 256 was more than the target
# allowed at 600-690k of a 1M-token prompt beside ~100 decodes (H200: 114-124 ms steps against a 100 ms target).
MIN_CHUNK = 64
# A later prefill of the step sized below this gets nothing instead (unless that is all it has left): a chunk
# scans its whole context whatever its size, and below it with a few CTAs (H200, a 1M-token prompt: 3-63 tokens
# at 550-690k beside a short prompt made 140-197 ms steps, the short prompt alone ~60 ms).
MIN_SIDE_CHUNK = 64
# A chunk sized for a target grows at most this much over the request's last one: the step cost model is fitted
# on the chunks it has seen (its pairs and scan terms are nearly collinear at one context) and its prediction
# far beyond them is not to be trusted (H200: 4,096-token chunks at 280-640k predicted at 0-100 ms took 0.37-0.8 s).
MAX_CHUNK_GROWTH = 2
# GUEST: a request on borrowed KV (``request.borrowed``) is not sized for the target: each layer of its step waits
# for its lenders' answers, a cost nearly independent of the chunk (H200, 8B shape: 64-token chunks took 180-300 ms
# against ~6 ms without a guest), so shrinking its chunk only multiplies its steps (a 300k-token prompt went at
# 64 tokens a step, 128k tokens in 480 s); it gets ``long_prefill_token_threshold`` or the budget.


def is_decoding(request: ScheduledRequest) -> bool:
    """One token to compute: its next decode (what the cost model counts as a decode)."""
    return request.num_tokens_with_pending - request.num_computed_tokens <= 1


class PrefillSizer:
    def __init__(self, config: SchedulerConfig, cost: CostModel, running: Iterable[ScheduledRequest]) -> None:
        self.cost = cost
        chunked = config.enable_chunked_prefill  # without it a prompt is never split
        self.threshold = config.long_prefill_token_threshold if chunked else 0
        self.max_partial = config.max_num_partial_prefills
        self.max_long = config.max_long_partial_prefills
        # the target is a 99th percentile's: aimed below by how far recent mixed steps overran (``Overruns``)
        self.target = config.itl_target / cost.overrun() if chunked and config.itl_target is not None else None
        # the largest chunk of a prompt pipelined through the stages (None: no pipeline)
        self.pipelined = (self.threshold or config.max_num_batched_tokens) \
            if chunked and config.pipeline_parallel_size > 1 else None
        self.num_stages = config.pipeline_parallel_size
        # a running prefill with more than this left lets short waiting prompts in first (``short_first``)
        self._short_first = 0 if not chunked or self.max_partial > 1 else \
            (self.threshold or config.max_num_batched_tokens)
        self.min_chunk = config.spp_min_chunk_tokens
        self.wave = config.attention_wave_tokens
        decodes = sum(1 for request in running if is_decoding(request))
        self.num_decodes = min(decodes, config.max_num_seqs)
        self.prefill_tokens = 0  # taken by this pass's prefills so far
        self.prefill_pairs = 0.0
        self.prefill_scan = 0.0
        self.num_prefills = 0
        self.num_long = 0

    @property
    def short_first(self) -> int:
        """The tokens left above which a running prefill lets short waiting prompts in first (``yielding``):
        vLLM's ``long_prefill_token_threshold``, else the step's token budget (a prompt that needs more than
        one step); 0 without chunked prefill and with concurrent partial prefills, whose V0 rules (a long
        prefill keeps its place, the shorter ones share the step) stay as they are."""
        return self._short_first

    def is_long(self, request: ScheduledRequest) -> bool:
        return 0 < self.threshold < request.num_tokens - request.num_computed_tokens

    def admits(self, request: ScheduledRequest) -> bool:
        """Whether the prefill may run in this step (the concurrent partial prefill limits)."""
        if self.max_partial <= 1:
            return True
        if self.num_prefills >= self.max_partial:
            return False
        return not (self.is_long(request) and self.num_long >= self.max_long)

    def chunk(self, request: ScheduledRequest, num_new: int) -> int:
        """The tokens the prefill gets of the ``num_new`` the budget allows (0: none this step)."""
        if 0 < self.threshold < num_new:
            num_new = self.threshold
        if self.pipelined is not None:
            remaining = max(request.num_tokens - request.num_computed_tokens, num_new)
            num_new = min(num_new, balanced_chunk(self.cost, request.num_computed_tokens, remaining, self.pipelined,
                                                     num_stages=self.num_stages, align=CHUNK_ALIGN,
                                                     min_chunk=self.min_chunk, wave=self.wave))
        if self.target is None or not self.num_decodes:
            return num_new  # nobody's next token waits on this step
        if request.borrowed:  # a guest's step waits on its lenders every layer, whatever the chunk: see GUEST
            return num_new
        start = request.num_computed_tokens
        trusted = min(num_new, MAX_CHUNK_GROWTH * request.last_chunk) if request.last_chunk else num_new
        if request.timed_chunk and request.chunk_seconds > 0:  # what its chunks cost, not what the model says
            room = max(self.target - self._step_seconds(start, 0), 0.0)
            trusted = min(trusted, int(request.timed_chunk * room / request.chunk_seconds))
        fits, low, high = 0, 1, trusted
        while low <= high:  # the step time grows with the chunk: the largest that keeps the target
            middle = (low + high) // 2
            if self._step_seconds(start, middle) <= self.target:
                fits, low = middle, middle + 1
            else:
                high = middle - 1
        if self.num_prefills:
            return fits if fits >= MIN_SIDE_CHUNK or fits >= request.num_tokens - start else 0
        return max(fits, min(num_new, MIN_CHUNK))

    def predicted_seconds(self) -> float:
        """The step's predicted time with the prefills taken so far and its decodes."""
        return self.cost.step_seconds(self.prefill_tokens, self.num_decodes, self.prefill_pairs, self.prefill_scan)

    def took(self, request: ScheduledRequest, num_new: int) -> None:
        """The prefill was given ``num_new`` tokens from its computed ones (before they advance)."""
        request.last_chunk = num_new
        if self.is_long(request):
            self.num_long += 1
        self.num_prefills += 1
        self.prefill_tokens += num_new
        self.prefill_pairs += chunk_pairs(request.num_computed_tokens, num_new)
        self.prefill_scan += chunk_scan(request.num_computed_tokens, num_new)

    def _step_seconds(self, start: int, num_new: int) -> float:
        return self.cost.step_seconds(self.prefill_tokens + num_new, self.num_decodes,
                                      self.prefill_pairs + chunk_pairs(start, num_new),
                                      self.prefill_scan + chunk_scan(start, num_new))


def note_chunk_times(plan: StepPlan, result: StepResult, requests: Mapping[str, ScheduledRequest],
                     cost: CostModel, block_size: int, features: StepFeatures | None = None) -> None:
    """Each prefill chunk of a step that held decodes: its tokens and its seconds (the step's wall share
    less the cost model's prediction of the step without it), which cap the request's next chunk
    (``PrefillSizer.chunk``) where the model's prediction runs short of what the chunks take.
    ``features``: the plan's ``step_features`` where the caller has them."""
    seconds = step_wall_seconds(result)
    if seconds <= 0 or not plan.req_ids or read_back_with_previous(result):
        return  # not measured, or read back with the step before (which holds both times: ``late_timings``)
    prefill_tokens, num_decodes, pairs, scan = features or step_features(plan, block_size)
    if not prefill_tokens or not num_decodes:
        return
    drafts = plan.draft_token_ids
    for request_id, n, blocks in zip(plan.req_ids, plan.num_tokens, plan.num_blocks, strict=True):
        if n - len(drafts.get(request_id, ())) == 1:
            continue
        request = requests.get(request_id)
        if request is None:
            continue
        start = max(0, blocks * block_size - n)  # as ``step_features`` takes it
        rest = cost.step_seconds(prefill_tokens - n, num_decodes, pairs - chunk_pairs(start, n),
                                 scan - chunk_scan(start, n))
        request.timed_chunk, request.chunk_seconds = n, max(seconds - rest, 0.0)


def yielding(policy: QueuePolicy, waiting: Sequence[ScheduledRequest],
             running: Sequence[ScheduledRequest], threshold: int = 0) -> set[str]:
    """The running prefills that let waiting requests (those that can be admitted now) in first at
    this chunk boundary, taking what the step has left: under the deadline policies (edf, lrs: those
    that take slots for more urgent requests) those a waiting request outranks by the policy's key;
    under any policy, with ``threshold`` (``PrefillSizer.short_first``) above 0, a prefill with more
    than it left while a prompt with no more than it waits (Medha's point: a short request behind a
    1M-token prefill otherwise waits for all of it)."""
    if not waiting:
        return set()
    prefills = [request for request in running if not is_decoding(request)]
    if not prefills:
        return set()
    ready = [request for request in waiting if not request.num_pending]
    deferred: set[str] = set()
    if threshold > 0 and any(request.num_tokens - request.num_computed_tokens <= threshold for request in ready):
        deferred = {request.request_id for request in prefills
                    if request.num_tokens - request.num_computed_tokens > threshold}
    if policy.preempts_for_slots:
        deferred |= {request.request_id for request in prefills
                     if any(policy.outranks(candidate, request) for candidate in ready)}
    return deferred
