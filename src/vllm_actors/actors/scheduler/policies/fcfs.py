"""``fcfs``: arrival order (vLLM's default); the latest arrival is preempted."""

from __future__ import annotations

from vllm_actors.actors.scheduler.policies.base import QueuePolicy


class FirstComeFirstServed(QueuePolicy):
    name = "fcfs"
