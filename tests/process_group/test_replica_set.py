"""Replica sets (data_parallel_size > 1) as processes: DP=2 against DP=1 through ``LLM`` and
``serve``, the routing policies in a running set, cache-aware routing's prefix hit rate against
round robin's (read from the metrics store), and a replica's worker killed without the other
replica's requests noticing."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server_helpers import free_port, gone, kill_when, start_server, stop_process, wait_healthy
from vllm_actors import LLM, SamplingParams
from vllm_actors.observe.tap import query_metrics
from vllm_actors.protocol.events import PipelineReset, Preempted, Routed
from vllm_actors.protocol.metrics import EventsQuery, EventsReply, SummaryQuery, SummaryReply
from vllm_actors.runtime.run_dir import read_group_info

PROMPTS = [{"prompt_token_ids": [7 + i, 40 + 3 * i, 90 + i, 200 + 5 * i, 11]} for i in range(8)]
MORE = [{"prompt_token_ids": [300 + i, 17, 23 + i, 5, 66, 150 + i]} for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Wait for a condition (the timeout is a safety net, not part of the test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def routed_events(query: Callable[[Any], Any]) -> list[Routed]:
    reply = query(EventsQuery(since_index=0, limit=10_000))
    assert isinstance(reply, EventsReply)
    return [entry.event for entry in reply.events if isinstance(entry.event, Routed)]


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path) -> dict[str, list[list[int]]]:
    """DP=1 (one engine in this process): the greedy outputs every replica set must reproduce."""
    with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32") as llm:
        return {"short": token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
                "long": token_ids(llm.generate(PROMPTS + MORE, LONG, use_tqdm=False))}


@pytest.fixture(scope="module")
def dp2(tiny_qwen3: Path) -> Iterator[LLM]:
    with LLM(str(tiny_qwen3), dtype="float32", data_parallel_size=2) as llm:
        yield llm
    assert all(gone(pid) for pid in llm_pids(llm))


def llm_pids(llm: LLM) -> list[int]:
    return list(llm.group.pids().values()) if llm.group is not None else []


def test_dp2_through_llm_gives_dp1s_greedy_outputs_round_robin(dp2: LLM, reference: dict[str, Any]) -> None:
    group = dp2.group
    assert group is not None
    assert {"controller", "scheduler@0", "scheduler@1", "worker-0@0", "worker-0@1", "kv_cache_manager@1"} <= set(
        group.pids())
    before = [dp2.get_metrics(replica).requests_finished for replica in (0, 1)]
    assert token_ids(dp2.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference["short"]
    wait_until(lambda: dp2.get_metrics().requests_finished >= sum(before) + len(PROMPTS), "the store saw every finish")
    total = dp2.get_metrics()
    per_replica = [dp2.get_metrics(replica) for replica in (0, 1)]
    assert total.replicas == [0, 1] and [s.replica for s in per_replica] == [0, 1]
    assert [s.requests_finished - b for s, b in zip(per_replica, before, strict=True)] == [4, 4]  # in turn
    assert total.generation_tokens == sum(s.generation_tokens for s in per_replica)
    routed = routed_events(dp2.engine.query_metrics)
    assert [event.replica for event in routed][-8:] == [0, 1] * 4
    assert {event.reason for event in routed} == {"round_robin"}
    stats = subprocess.run([sys.executable, "-m", "vllm_actors", "stats", "--run-dir", str(group.run_dir)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--- replica 0 ---" in stats and "--- replica 1 ---" in stats  # the sum, then each replica
    one = subprocess.run([sys.executable, "-m", "vllm_actors", "stats", "--run-dir", str(group.run_dir), "--json",
                          "--replica", "1"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(one)["replica"] == 1


@pytest.mark.parametrize("policy", ["least_loaded", "pull"])
def test_each_policy_routes_as_it_should_and_changes_no_output(tiny_qwen3: Path, reference: dict[str, Any],
                                                                policy: str) -> None:
    # pull: each replica takes two requests at a time; the rest wait in the controller for a slot
    with LLM(str(tiny_qwen3), dtype="float32", data_parallel_size=2, routing_policy=policy, max_num_seqs=2) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference["short"]
        wait_until(lambda: len(routed_events(llm.engine.query_metrics)) == len(PROMPTS), "every ROUTED event")
        routed = routed_events(llm.engine.query_metrics)
        pids = llm_pids(llm)
    assert all(gone(pid) for pid in pids)
    replicas = [event.replica for event in routed]
    if policy == "least_loaded":  # each to the replica with fewer in flight: the first two to 0 then 1; after
        # that, which replica has finished one when the next arrives is the machine's business (the choice
        # itself is checked exactly in tests/state_machines)
        assert replicas[:2] == [0, 1] and set(replicas) == {0, 1}
        assert {event.reason for event in routed} == {"least_loaded"}
    else:  # four free slots (two per replica), then a slot each time a replica finishes one
        # (which replica frees a slot first is the machine's business: both serve, neither holds more than two)
        assert [event.reason for event in routed] == ["pull"] * 4 + ["pulled"] * 4
        assert replicas[:4] == [0, 1, 0, 1] and set(replicas[4:]) <= {0, 1}


# --------------------------------------------------------------------------- cache-aware routing
TENANTS = 8
SYSTEM_TOKENS = 1000
WAVES = 4
POOL_BLOCKS = 260  # per replica: about four tenants' system prompts (62 blocks each)


def tenant_prompts(vocab_size: int) -> list[list[dict[str, list[int]]]]:
    """WAVES waves, each one request per tenant in a shuffled order (fixed seed): a tenant's
    1,000-token system prompt, then a few tokens of its own."""
    rng = random.Random(17)
    systems = [[rng.randrange(1, vocab_size) for _ in range(SYSTEM_TOKENS)] for _ in range(TENANTS)]
    waves = []
    for wave in range(WAVES):
        order = list(range(TENANTS))
        rng.shuffle(order)
        waves.append([{"prompt_token_ids": systems[t] + [1 + wave, 2 + t, 3, 4]} for t in order])
    return waves


def prefix_hit_rate(tiny_qwen3: Path, policy: str) -> tuple[float, list[Routed]]:
    with LLM(str(tiny_qwen3), dtype="float32", data_parallel_size=2, routing_policy=policy,
             num_gpu_blocks_override=POOL_BLOCKS) as llm:
        done = 0
        for wave in tenant_prompts(llm.vocab_size):
            llm.generate(wave, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
            done += len(wave)
            # the next wave goes out once the store has seen this one end (and with it the cache events)
            wait_until(lambda: llm.get_metrics().requests_finished >= done, "the wave ended in the store")  # noqa: B023
        summary = llm.get_metrics()
        routed = routed_events(llm.engine.query_metrics)
    assert summary.prefix_cache_queries > 0
    return summary.prefix_cache_hits / summary.prefix_cache_queries, routed


def test_cache_aware_routing_doubles_round_robins_prefix_hit_rate(tiny_qwen3: Path) -> None:
    round_robin, _ = prefix_hit_rate(tiny_qwen3, "round_robin")
    cache_aware, routed = prefix_hit_rate(tiny_qwen3, "cache_aware")
    assert cache_aware >= 2 * round_robin, (cache_aware, round_robin)
    assert cache_aware > 0.6  # after the first wave nearly every system prompt is found cached
    assert sum(event.reason == "cache_hit" for event in routed) >= TENANTS * (WAVES - 1) - 2


# --------------------------------------------------------------------------- failure containment
@pytest.mark.parametrize("actor", ["worker-0@1", "scheduler@1"])
def test_killing_one_replicas_actor_loses_no_request_of_the_other(dp2: LLM, reference: dict[str, Any],
                                                                 actor: str) -> None:
    # the module's set serves each kill in turn: what a case checks is what happened since it began
    llm, group = dp2, dp2.group
    assert group is not None
    wait_until(lambda: set(group.state().values()) == {"ready"}, "every actor ready before the fault")
    victim, restarts_before = group.pids()[actor], group.restarts()
    since = _event_cursor(llm)
    tokens_before, resets_before = llm.get_metrics(1).generation_tokens, llm.get_metrics().pipeline_resets
    killer, killed = kill_when(lambda: llm.get_metrics(1).generation_tokens > tokens_before + 32, victim)
    outputs = llm.generate(PROMPTS + MORE, LONG, use_tqdm=False)
    killer.join(timeout=10)
    assert killed.is_set(), f"{actor} was not killed during the run"
    restarts = group.restarts()
    assert group.pids()[actor] != victim
    assert {name: count - restarts_before.get(name, 0) for name, count in restarts.items()
            if count != restarts_before.get(name, 0)} == {actor: 1}
    if actor.startswith("worker"):
        wait_until(lambda: llm.get_metrics().pipeline_resets >= resets_before + 1, "the reset reached the store")
    events = _events(llm, since)
    assert token_ids(outputs) == reference["long"], actor
    assert all(output.outputs[0].finish_reason == "length" for output in outputs)
    by_actor = [(entry.actor, entry.event) for entry in events.events]
    resets = [name for name, event in by_actor if isinstance(event, PipelineReset)]
    assert resets == (["scheduler@1"] if actor.startswith("worker") else [])  # only the replica that lost its worker
    # replica 0 never noticed: none of its requests was preempted or sent again
    assert not [event for name, event in by_actor if name == "scheduler@0" and isinstance(event, Preempted)]


def _event_cursor(llm: LLM) -> int:
    """The index the store's next event will have."""
    since, reply = 0, _events(llm, 0)
    while reply.events:
        since = reply.next_index
        reply = _events(llm, since)
    return max(since, reply.next_index)


def _events(llm: LLM, since: int) -> EventsReply:
    reply = llm.engine.query_metrics(EventsQuery(since_index=since, limit=10_000))
    assert isinstance(reply, EventsReply)
    return reply


# --------------------------------------------------------------------------- serve
@pytest.fixture(scope="module")
def served(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    directory = tmp_path_factory.mktemp("dp-serve")
    run_root, log_path, port = directory / "runs", directory / "server.log", free_port()
    process = start_server(tiny_qwen3, port, log_path, run_root, "--data-parallel-size", "2")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log_path)
        (run_dir,) = [path.parent for path in run_root.glob("*/group.json")]
        yield f"http://127.0.0.1:{port}", run_dir
    finally:
        stop_process(process)
    assert process.returncode == 0


def test_dp2_through_serve_gives_dp1s_outputs_sticky_sessions_and_per_replica_metrics(
        served: tuple[str, Path], reference: dict[str, Any], tiny_qwen3: Path) -> None:
    base_url, run_dir = served
    info = read_group_info(run_dir)
    assert info.data_parallel_size == 2

    def complete(prompt: dict[str, list[int]], request_id: str, session: str | None = None) -> list[int]:
        headers = {"X-Request-Id": request_id, **({"X-Session-Id": session} if session else {})}
        body = {"model": str(tiny_qwen3), "prompt": prompt["prompt_token_ids"], "max_tokens": 8,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        return list(response.json()["choices"][0]["token_ids"])

    results: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(PROMPTS[i], f"p{i}")))
               for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(len(PROMPTS))] == reference["short"]
    for turn in range(3):  # sticky: each session stays on the replica its first request went to
        complete(PROMPTS[turn], f"alice{turn}", session="alice")
        complete(PROMPTS[turn], f"bob{turn}", session="bob")
    carol = {"model": str(tiny_qwen3), "prompt": [5, 6], "user": "carol", "max_tokens": 1}
    response = httpx.post(f"{base_url}/v1/completions", json=carol, headers={"X-Request-Id": "carol0"})
    assert response.status_code == 200

    def query(message: Any) -> Any:
        return query_metrics(info.addresses.metrics, message)

    sessions = ("alice", "bob")
    wait_until(lambda: sum(e.request_id.startswith(("cmpl-alice", "cmpl-bob")) for e in routed_events(query)) == 6,
               "every ROUTED event")
    routed = {event.request_id: event for event in routed_events(query)}
    for name in sessions:
        mine = [routed[f"cmpl-{name}{turn}-0"] for turn in range(3)]
        assert len({event.replica for event in mine}) == 1, mine
        assert [event.reason for event in mine] == ["round_robin", "sticky", "sticky"]
    assert "cmpl-carol0-0" in routed  # the body's user field is a session key too
    summary = query(SummaryQuery())
    assert isinstance(summary, SummaryReply) and summary.replicas == [0, 1]
    metrics = httpx.get(f"{base_url}/metrics").text
    running = [line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running{")]
    assert sorted('engine="0"' in line for line in running) == [False, True]
    assert any('engine="1"' in line for line in running)
    assert httpx.get(f"{base_url}/health").status_code == 200
