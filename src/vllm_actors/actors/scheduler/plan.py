"""One planning pass's decisions turned into the step's ``StepPlan``: the requests given tokens, in
the batch's order, each with its blocks and token count; the new requests; the blocks cached as
they fill (at planning time, so that a request admitted later in the same pass already hits them)."""

from __future__ import annotations

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.protocol.events import PrefillChunk
from vllm_actors.protocol.messages import NewRequest, StepPlan


class StepBuilder:
    def __init__(self, step_id: int, budget: int, ledger: BlockLedger) -> None:
        self.step_id = step_id
        self.budget = budget  # tokens left to give this step
        self.ledger = ledger
        self.scheduled: list[tuple[ScheduledRequest, int]] = []
        self.new_requests: list[NewRequest] = []
        self.cached: dict[str, list[int]] = {}  # hashes of the blocks each request caches this step
        self.drafts: dict[str, list[int]] = {}  # speculative decoding: drafted tokens per request

    def take(self, request: ScheduledRequest, num_new: int, num_blocks: int, new: NewRequest | None = None,
             drafts: list[int] | None = None) -> None:
        """The request computes ``num_new`` tokens this step with ``num_blocks`` more blocks
        (``new``: the worker learns of it with this step; ``drafts``: the last of its tokens are
        these drafted ones, verified by the worker)."""
        self._allocate(request, num_new, num_blocks)
        if drafts:
            self.drafts[request.request_id] = drafts
        if new is not None:
            self.new_requests.append(new)
        self.scheduled.append((request, num_new))
        self.budget -= num_new

    def _allocate(self, request: ScheduledRequest, num_new: int, num_blocks: int) -> None:
        """Give the request its blocks, then cache its full blocks whose KV this step (or an
        earlier one) writes and whose tokens are known (a decode step's input may still be in
        flight: cached in a later pass)."""
        ledger = self.ledger
        ledger.allocate(request.request_id, num_blocks)
        computed = min(request.num_computed_tokens + num_new, request.num_tokens)
        if ledger.cache is None or computed < request.cache_check_at:
            return
        hashes = ledger.cache_blocks(request.request_id, computed // ledger.block_size, request.token_slice,
                                     back_up=ledger.writes_through(len(request.prompt_token_ids)))
        request.cache_check_at = ledger.next_cache_check(request.request_id)
        if hashes:
            self.cached[request.request_id] = hashes

    def build(self, reset: bool, finished_ids: list[str],
              trimmed: dict[str, int] | None = None) -> tuple[StepPlan, list[str], list[PrefillChunk], int]:
        """The plan; the requests it samples a token for (each now has one more pending); the
        prefill events; the number of prefills it leaves unfinished (chunked)."""
        sampling_ids: list[str] = []
        chunks: list[PrefillChunk] = []
        num_partial = 0
        for request, num_new in self.scheduled:
            start = request.num_computed_tokens
            target = request.num_tokens_with_pending
            if start + num_new - len(self.drafts.get(request.request_id, ())) < target:
                num_partial += 1
            else:
                sampling_ids.append(request.request_id)
                request.num_pending += 1
                request.num_pending_drafts += len(self.drafts.get(request.request_id, ()))
            if target - start > 1 or not request.output_token_ids:  # prefill, not decode
                chunks.append(PrefillChunk(request_id=request.request_id, step_id=self.step_id, start=start,
                                           num_tokens=num_new, last=start + num_new == target))
            request.num_computed_tokens += num_new
        dropped, restored = self.ledger.take_host_moves(self.step_id)
        plan = StepPlan(
            step_id=self.step_id,
            reset=reset,
            new_requests=self.new_requests,
            finished_ids=finished_ids,
            req_ids=[request.request_id for request, _ in self.scheduled],
            num_tokens=[num_new for _, num_new in self.scheduled],
            num_blocks=[self.ledger.num_blocks(request.request_id) for request, _ in self.scheduled],
            evicted_hashes=self.ledger.take_evicted(),
            cached_hashes=self.cached,
            host_dropped_hashes=dropped,
            restored_hashes=restored,
            draft_token_ids=self.drafts,
            trimmed_blocks=trimmed or {},
            backup_hashes=self.ledger.take_backups(),
            keep_host_tier=reset and self.ledger.host_resumed,
        )
        return plan, sampling_ids, chunks, num_partial
