"""``lpm``: SGLang's longest cached prefix first for the waiting queue; running requests as fcfs."""

from __future__ import annotations

from collections import deque

from vllm_actors.actors.scheduler.admission import looks_up
from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.policies.base import QueuePolicy
from vllm_actors.actors.scheduler.request import ScheduledRequest

# Longest-prefix-first ordering looks every waiting request up each pass: past this many
# waiting requests it costs more than it saves, and arrival order is kept (as SGLang does).
LPM_MAX_WAITING = 128


class LongestPrefixMatch(QueuePolicy):
    name = "lpm"

    def order_waiting(self, waiting: deque[ScheduledRequest], ledger: BlockLedger) -> deque[ScheduledRequest]:
        """The waiting requests with the most cached blocks first (stable: equal hits keep arrival
        order). A request still waiting for a token in flight goes last (it cannot be admitted yet
        and must not block the others). Past ``LPM_MAX_WAITING``: arrival order."""
        if not 1 < len(waiting) <= LPM_MAX_WAITING:
            return waiting
        hits = {
            request.request_id: ledger.cached_prefix_blocks(request.all_token_ids, request.lora_int_id)
            for request in waiting
            if looks_up(request, ledger)
        }
        return deque(sorted(waiting, key=lambda r: (r.num_pending > 0, -hits.get(r.request_id, 0))))
