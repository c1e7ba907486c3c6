"""Replica sets, in process: the routing policies (pure: round robin, least loaded, pull, cache-aware
over a mirror of each replica's prefix cache) and sticky sessions. The controller around them:
test_controller.py; replica names, metrics and health: test_replica_names.py."""

from __future__ import annotations

from vllm_actors.actors.controller.prefix_mirror import PrefixMirror, prompt_block_hashes
from vllm_actors.actors.controller.routing import Router, RouteRequest
from vllm_actors.protocol.block_hash import block_hash
from vllm_actors.protocol.events import BlockCached, BlockEvicted, KvPool

BLOCK = 4


def request(request_id: str, tokens: list[int] | None = None, key: str | None = None) -> RouteRequest:
    return RouteRequest(request_id, tokens if tokens is not None else [1, 2, 3], key)


def cached(tokens: list[int], blocks: int) -> BlockCached:
    hashes = prompt_block_hashes(tokens, BLOCK)[:blocks]
    return BlockCached(request_id="x", parent_hash=0, block_ids=list(range(len(hashes))), block_hashes=hashes)


def test_round_robin_takes_replicas_in_turn_and_skips_one_that_is_down() -> None:
    router = Router("round_robin", 3)
    assert [router.route(request(str(i))).replica for i in range(4)] == [0, 1, 2, 0]  # type: ignore[union-attr]
    router.set_up(1, False)
    assert [router.route(request(str(i))).replica for i in range(3)] == [2, 0, 2]  # type: ignore[union-attr]


def test_least_loaded_takes_the_replica_with_fewest_requests_then_the_emptier_pool() -> None:
    router = Router("least_loaded", 2)
    assert router.route(request("a")).replica == 0  # type: ignore[union-attr]
    assert router.route(request("b")).replica == 1  # type: ignore[union-attr]
    assert router.route(request("c")).replica == 0  # type: ignore[union-attr]
    router.release(0)
    router.release(0)  # replica 0 is empty now, replica 1 holds one
    assert router.route(request("d")).replica == 0  # type: ignore[union-attr]
    router.observe(0, KvPool(num_blocks=100, num_free=10, num_cached=0, num_cached_idle=0, num_in_use=90))
    router.release(0)  # both empty: the pool decides
    router.release(1)
    assert router.route(request("e")).replica == 1  # type: ignore[union-attr]


def test_pull_holds_requests_until_a_replica_has_room_and_gives_the_oldest_to_the_one_that_freed() -> None:
    router = Router("pull", 2, capacity=1)
    first, second = router.route(request("a")), router.route(request("b"))
    assert (first.replica, second.replica, first.reason) == (0, 1, "pull")  # type: ignore[union-attr]
    assert router.route(request("c")) is None and router.route(request("d")) is None  # both full: they wait
    assert list(router.held) == ["c", "d"]
    dispatched = router.release(1)  # replica 1 has room: it takes the oldest
    assert [(r.request_id, d.replica, d.reason) for r, d in dispatched] == [("c", 1, "pulled")]
    assert router.drop("d") and router.release(0) == []  # aborted while waiting: nothing left to pull
    assert [view.in_flight for view in router.replicas] == [0, 1]


def test_cache_aware_follows_the_mirrored_prefix_and_falls_back_to_load() -> None:
    router = Router("cache_aware", 2, block_size=BLOCK)
    tenant = list(range(100, 116))  # four full blocks
    router.observe(1, cached(tenant, 4))
    decision = router.route(request("a", tenant + [7]))
    assert (decision.replica, decision.reason, decision.cached_blocks) == (1, "cache_hit", 4)  # type: ignore[union-attr]
    assert router.route(request("b", tenant + [8])).replica == 1  # type: ignore[union-attr]
    # a prefix nobody holds goes to the least loaded replica
    other = router.route(request("c", list(range(500, 516))))
    assert (other.replica, other.reason) == (0, "cache_aware")  # type: ignore[union-attr]
    # a cached run too short for the prompt does not pull it over
    short = router.route(request("d", tenant[:4] + list(range(900, 920))))
    assert short.reason == "cache_aware"  # type: ignore[union-attr]
    # evicted blocks are gone from the mirror
    hashes = prompt_block_hashes(tenant, BLOCK)
    router.observe(1, BlockEvicted(block_ids=[2, 3], block_hashes=hashes[2:], parent_hashes=hashes[1:3]))
    assert router.replicas[1].mirror.match(hashes) == 2
    router.pool_lost(1)
    assert router.replicas[1].mirror.match(hashes) == 0


def test_cache_aware_balances_a_replica_that_is_far_ahead() -> None:
    router = Router("cache_aware", 2, block_size=BLOCK, balance_abs_threshold=2, balance_rel_threshold=1.5)
    tenant = list(range(100, 116))
    router.observe(1, cached(tenant, 4))
    assert [router.route(request(str(i), tenant)).replica for i in range(3)] == [1, 1, 1]  # type: ignore[union-attr]
    decision = router.route(request("x", tenant))  # 3 against 0: past both thresholds
    assert (decision.replica, decision.reason) == (0, "cache_aware")  # type: ignore[union-attr]


def test_sticky_sessions_stay_on_their_replica_over_any_policy() -> None:
    router = Router("round_robin", 2)
    first = router.route(request("a", key="alice"))
    assert [router.route(request(str(i), key="alice")).replica for i in range(3)] == [first.replica] * 3  # type: ignore[union-attr]
    assert router.route(request("b", key="bob")).reason == "round_robin"  # type: ignore[union-attr]
    router.set_up(first.replica, False)  # type: ignore[union-attr]
    moved = router.route(request("c", key="alice"))
    assert moved.replica != first.replica and moved.reason == "round_robin"  # type: ignore[union-attr]
    bounded = Router("least_loaded", 2, max_sessions=2)
    for key in ("k1", "k2", "k3"):
        bounded.route(request(key, key=key))
    assert list(bounded.sessions) == ["k2", "k3"]


def test_the_mirror_hashes_blocks_as_the_prefix_cache_names_them() -> None:
    tokens = list(range(10))
    first = block_hash(0, tokens[0:4])
    assert prompt_block_hashes(tokens, 4) == [first, block_hash(first, tokens[4:8])]  # the partial block is not cached
    mirror = PrefixMirror()
    mirror.apply(BlockCached(request_id="r", parent_hash=0, block_ids=[0], block_hashes=[first]))
    assert mirror.match(prompt_block_hashes(tokens, 4)) == 1


def test_pull_with_sticky_sessions_waits_for_a_slot_on_the_sessions_replica() -> None:
    router = Router("pull", 2, capacity=1)
    assert router.route(request("a", key="alice")).replica == 0  # type: ignore[union-attr]
    assert router.route(request("b")).replica == 1  # type: ignore[union-attr]
    assert router.route(request("c", key="alice")) is None  # replica 0 is full
    assert router.route(request("d")) is None
    # replica 1 frees a slot: "c" waits for alice's replica, so the next waiting request takes it
    assert [(r.request_id, d.replica) for r, d in router.release(1)] == [("d", 1)]
    assert [(r.request_id, d.replica) for r, d in router.release(0)] == [("c", 0)]
    assert not router.held




def test_cache_aware_routes_a_prompt_no_hash_takes_on_what_it_could_hash() -> None:
    # a client's mistake (a negative id, one past 2**32) must not crash the controller: the replica's
    # scheduler refuses the request, saying why
    router = Router("cache_aware", 2, block_size=BLOCK)
    tenant = list(range(100, 116))
    router.observe(1, cached(tenant, 4))
    assert prompt_block_hashes(tenant[:8] + [-1, 2, 3, 4], BLOCK) == prompt_block_hashes(tenant, BLOCK)[:2]
    decision = router.route(request("a", tenant + [-5, 1, 2, 3]))
    assert decision is not None and decision.replica == 1
    assert router.route(request("b", [2**32, 1, 2, 3])) is not None
