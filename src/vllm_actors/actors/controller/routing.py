"""Routing decisions of a replica set: which replica serves a request. Pure: no sockets, no clock.

Policies (``EngineConfig.routing_policy``, ``--routing-policy``):

* ``round_robin``: replicas in turn.
* ``least_loaded``: the replica with the fewest requests in flight (routed and not yet finished or
  aborted: the replica's running plus waiting), then the lowest KV usage (its latest ``KV_POOL``).
* ``pull`` (Vajra's pull-based balancing): a replica takes work only when it has room. Each replica
  offers ``capacity`` slots (its ``max_num_seqs``); a request takes the oldest free slot offered,
  and waits in the controller while none is free; a replica that finishes a request offers its
  slot again and takes the oldest waiting request. The backlog stays in one queue, not behind
  whichever replica happened to be picked.
* ``cache_aware`` (SGLang's router, with the cache read from events): each replica's prefix cache
  is mirrored from its ``BLOCK_CACHED`` / ``BLOCK_EVICTED`` events (``PrefixMirror``); a request
  goes to the replica holding the longest run of its prompt's blocks when that run covers at
  least ``cache_threshold`` of the prompt and the set is balanced; otherwise (a new prefix, or
  loads apart by more than ``balance_abs_threshold`` requests and a factor ``balance_rel_threshold``)
  to the least loaded replica, ties going to the one caching the fewest blocks.

Sticky sessions, over any policy: a request with a ``session_key`` goes where the key's first
request went (while that replica is up); keys are remembered least recently used first, at most
``max_sessions``. A replica that is down (restarting) gets no new request unless all are.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_actors.actors.controller.prefix_mirror import PrefixMirror, prompt_block_hashes
from vllm_actors.protocol.config import ROUTING_POLICIES
from vllm_actors.protocol.events import BlockCached, BlockEvicted, KvPool

DEFAULT_MAX_SESSIONS = 65_536
CACHE_THRESHOLD = 0.5  # SGLang router's cache_threshold
BALANCE_ABS_THRESHOLD = 32  # SGLang router's balance_abs_threshold
BALANCE_REL_THRESHOLD = 1.5


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    session_key: str | None = None


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str  # the policy's name, "sticky", "cache_hit", "pulled"
    cached_blocks: int = 0  # cache_aware: the prompt's blocks the mirror holds on that replica


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    in_flight: int = 0
    kv_usage: float = 0.0
    up: bool = True
    mirror: PrefixMirror = field(default_factory=PrefixMirror)


class Router:
    def __init__(self, policy: str, num_replicas: int, *, block_size: int = 16, capacity: int = 256,
                 max_sessions: int = DEFAULT_MAX_SESSIONS, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
                 balance_rel_threshold: float = BALANCE_REL_THRESHOLD) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        if num_replicas < 1 or capacity < 1:
            raise ValueError("a replica set needs at least one replica and a capacity of at least 1")
        self.policy = policy
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self.block_size = block_size
        self.capacity = capacity
        self.max_sessions = max_sessions
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self._next = 0  # round robin
        # pull: free slots in the order offered, and the requests waiting for one
        self.slots: deque[int] = deque(r for _ in range(capacity) for r in range(num_replicas))
        self.held: OrderedDict[str, RouteRequest] = OrderedDict()

    # ------------------------------------------------------------------ decisions
    def route(self, request: RouteRequest) -> Decision | None:
        """Where ``request`` goes now (its replica's in-flight count is taken), or None: it waits
        for a free slot (``pull`` only; ``release`` hands it out)."""
        pinned = self._sticky(request.session_key)
        if self.policy == "pull":
            if not self.held:
                slot = self._take_slot(pinned)
                if slot is not None:
                    return self._commit(request, Decision(slot, "sticky" if pinned is not None else "pull"))
            self.held[request.request_id] = request
            return None
        if pinned is not None:
            return self._commit(request, Decision(pinned, "sticky"))
        if self.policy == "round_robin":
            decision = Decision(self._round_robin(), "round_robin")
        elif self.policy == "least_loaded":
            decision = Decision(self._least_loaded(self._candidates()), "least_loaded")
        else:
            decision = self._cache_aware(request)
        return self._commit(request, decision)

    def release(self, replica: int) -> list[tuple[RouteRequest, Decision]]:
        """A request of ``replica`` ended (finished or aborted): its in-flight count drops; with
        ``pull`` the replica offers its slot, and what waited may go now (in arrival order)."""
        view = self.replicas[replica]
        view.in_flight = max(view.in_flight - 1, 0)
        if self.policy != "pull":
            return []
        self.slots.append(replica)
        dispatched: list[tuple[RouteRequest, Decision]] = []
        for request_id, request in list(self.held.items()):
            if not self.slots:
                break
            pinned = self._sticky(request.session_key, touch=False)
            slot = self._take_slot(pinned)
            if slot is None:
                continue  # pinned to a replica without room: the next waiting request may go
            del self.held[request_id]
            dispatched.append((request, self._commit(request, Decision(slot, "pulled"))))
        return dispatched

    def drop(self, request_id: str) -> bool:
        """Forget a waiting request (aborted before it was dispatched). True when it was waiting."""
        return self.held.pop(request_id, None) is not None

    # ------------------------------------------------------------------ what the router hears
    def observe(self, replica: int, event: object) -> None:
        """An event of one of ``replica``'s actors: its cache and its pool."""
        view = self.replicas[replica]
        if isinstance(event, (BlockCached, BlockEvicted)):
            view.mirror.apply(event)
        elif isinstance(event, KvPool):
            view.kv_usage = event.num_in_use / event.num_blocks if event.num_blocks else 0.0

    def set_up(self, replica: int, up: bool) -> None:
        self.replicas[replica].up = up

    def pool_lost(self, replica: int) -> None:
        """The replica's KV-cache manager restarted: its cache is empty."""
        self.replicas[replica].mirror.clear()

    # ------------------------------------------------------------------ the policies
    def _candidates(self) -> list[int]:
        up = [index for index, view in enumerate(self.replicas) if view.up]
        return up or list(range(len(self.replicas)))

    def _round_robin(self) -> int:
        candidates = set(self._candidates())
        for _ in range(len(self.replicas)):
            index = self._next % len(self.replicas)
            self._next += 1
            if index in candidates:
                return index
        return min(candidates)

    def _least_loaded(self, candidates: Sequence[int]) -> int:
        views = self.replicas
        return min(candidates, key=lambda index: (views[index].in_flight, views[index].kv_usage,
                                                  len(views[index].mirror), index))

    def _cache_aware(self, request: RouteRequest) -> Decision:
        candidates = self._candidates()
        loads = [self.replicas[index].in_flight for index in candidates]
        low, high = min(loads), max(loads)
        balanced = not (high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low)
        hashes = prompt_block_hashes(request.prompt_token_ids, self.block_size)
        matches = {index: self.replicas[index].mirror.match(hashes) for index in candidates}
        best = max(matches.values())
        covered = best * self.block_size / max(len(request.prompt_token_ids), 1)
        if balanced and best > 0 and covered >= self.cache_threshold:
            index = self._least_loaded([index for index in candidates if matches[index] == best])
            return Decision(index, "cache_hit", best)
        index = self._least_loaded(candidates)
        return Decision(index, "cache_aware", matches[index])

    # ------------------------------------------------------------------ bookkeeping
    def _sticky(self, key: str | None, touch: bool = True) -> int | None:
        if key is None:
            return None
        replica = self.sessions.get(key)
        if replica is None:
            return None
        if touch:
            self.sessions.move_to_end(key)
        all_down = not any(view.up for view in self.replicas)
        return replica if self.replicas[replica].up or all_down else None

    def _take_slot(self, pinned: int | None) -> int | None:
        for position, replica in enumerate(self.slots):
            if (pinned is None and (self.replicas[replica].up or not any(v.up for v in self.replicas))) \
                    or replica == pinned:
                del self.slots[position]
                return replica
        return None

    def _commit(self, request: RouteRequest, decision: Decision) -> Decision:
        self.replicas[decision.replica].in_flight += 1
        if request.session_key is not None:
            self.sessions[request.session_key] = decision.replica
            self.sessions.move_to_end(request.session_key)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return decision
