"""``lpm``: SGLang's longest cached prefix first for the waiting queue (``queue_policy``'s
ordering, arrival order past ``LPM_MAX_WAITING``); running requests as fcfs."""

from __future__ import annotations

from collections import deque

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.policies.base import QueuePolicy
from vllm_actors.actors.scheduler.queue_policy import order_longest_prefix_first
from vllm_actors.actors.scheduler.request import ScheduledRequest


class LongestPrefixMatch(QueuePolicy):
    name = "lpm"

    def order_waiting(self, waiting: deque[ScheduledRequest], ledger: BlockLedger) -> deque[ScheduledRequest]:
        return order_longest_prefix_first(waiting, ledger)
