"""Borrowed KV capacity in a running replica set (``kv_borrowing``, DP=2 on the CPU over gloo): a
2,500-token request whose KV does not fit one replica's pool of 120 blocks is served on its home
with blocks lent by the other replica, prefilled in chunks of 512, beside short requests on both
replicas in the same run. Every greedy token equals transformers' in float32; the events show the
loan taken and given back, and the lender's pool is whole again once the request ends."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TP_QWEN3_SHAPE
from tests.engine.test_correctness import reference_generate
from tests.support.server_helpers import gone
from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.events import KvLent, KvPool, KvReturned, Routed
from vllm_actors.protocol.metrics import EventsQuery, EventsReply

BLOCKS, BLOCK, MAX_TOKENS = 120, 16, 5
LONG = 2500  # 157 blocks with its outputs: more than a pool, less than the two shares (108 each)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("borrow_set"), "qwen3", tie_word_embeddings=True,
                            shape=TP_QWEN3_SHAPE | {"max_position_embeddings": 4096, "num_hidden_layers": 2})


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(500) for _ in range(n)] for n in (LONG, 40, 90, 70, 30)]


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[tuple[list[list[int]], list[tuple[str, Any]]]]:
    """The five requests through one DP=2 set; its outputs and every event of the run."""
    with LLM(str(checkpoint), dtype="float32", data_parallel_size=2, kv_borrowing=True, block_size=BLOCK,
             num_gpu_blocks_override=BLOCKS, max_num_batched_tokens=512, max_model_len=4096) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        events = all_events(llm.engine.query_metrics)
        deadline = time.monotonic() + 60  # the loan's return follows the finish: wait for its events
        while not any(isinstance(event, KvReturned) for _, event in events) and time.monotonic() < deadline:
            time.sleep(0.05)
            events = all_events(llm.engine.query_metrics)
        pids = list(llm.group.pids().values()) if llm.group is not None else []
    yield [list(output.outputs[0].token_ids) for output in outputs], events
    assert all(gone(pid) for pid in pids)


def all_events(query: Callable[[Any], Any]) -> list[tuple[str, Any]]:
    events: list[tuple[str, Any]] = []
    since = 0
    while True:
        reply = query(EventsQuery(since_index=since, limit=10_000))
        assert isinstance(reply, EventsReply) and not reply.missed
        events += [(entry.actor, entry.event) for entry in reply.events]
        if reply.next_index == since:
            return events
        since = reply.next_index


def test_a_request_longer_than_a_pool_runs_on_borrowed_blocks_with_transformers_tokens(
        served: tuple[list[list[int]], list[tuple[str, Any]]], checkpoint: Path) -> None:
    outputs, events = served
    want = [tokens for tokens, _ in reference_generate(checkpoint, prompts(), max_tokens=MAX_TOKENS)]
    assert outputs == want
    routed = {event.request_id: event for _, event in events if isinstance(event, Routed)}
    long_id = next(rid for rid, event in routed.items() if event.reason == "borrowed")
    home = routed[long_id].replica
    lender = 1 - home
    assert {event.replica for rid, event in routed.items() if rid != long_id} == {0, 1}  # shorts on both
    lent = [(actor, event) for actor, event in events if isinstance(event, KvLent)]
    returned = [(actor, event) for actor, event in events if isinstance(event, KvReturned)]
    assert [actor for actor, _ in lent] == [f"kv_cache_manager@{lender}"]
    # spread over the two shares in proportion (79 at the home, 78 lent), not the home's share first (108 + 49)
    assert lent[0][1].request_id == long_id and len(lent[0][1].block_ids) == 78
    assert [(actor, event.num_blocks) for actor, event in returned] == [(f"kv_cache_manager@{lender}",
                                                                         len(lent[0][1].block_ids))]
    pools = [event for actor, event in events if actor == f"kv_cache_manager@{lender}" and isinstance(event, KvPool)]
    assert pools[-1].num_in_use == 0 and pools[-1].num_free + pools[-1].num_cached == BLOCKS  # the loan is back


def test_a_killed_lender_takes_the_sets_workers_down_together_and_loses_nothing(checkpoint: Path) -> None:
    """The set's workers share one gloo world, which takes no worker back alone: SIGKILL of the lender's worker
    once its loan is out restarts every replica's worker, at a fresh store; each replica recomputes its requests
    (the long one on a loan taken again), and every greedy token is still transformers'. No process is left."""
    want = [tokens for tokens, _ in reference_generate(checkpoint, prompts(), max_tokens=MAX_TOKENS)]
    with LLM(str(checkpoint), dtype="float32", data_parallel_size=2, kv_borrowing=True, block_size=BLOCK,
             num_gpu_blocks_override=BLOCKS, max_num_batched_tokens=512, max_model_len=4096) as llm:
        group = llm.group
        assert group is not None
        before = group.pids()
        killed: list[str] = []
        killer = threading.Thread(target=_kill_the_lender, args=(llm, before, killed), daemon=True)
        killer.start()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        killer.join(timeout=10)
        assert killed, "the lender's worker was not killed while the loan was out"
        after = group.pids()
        workers = [actor for actor in before if actor.startswith("worker")]
        assert len(workers) == 2 and all(after[actor] != before[actor] for actor in workers)  # restarted together
        assert {actor: group.restarts().get(actor) for actor in workers} == dict.fromkeys(workers, 1)
        every_pid = set(before.values()) | set(after.values())
    assert [list(output.outputs[0].token_ids) for output in outputs] == want
    assert all(gone(pid) for pid in every_pid)


def _kill_the_lender(llm: LLM, pids: dict[str, int], killed: list[str]) -> None:
    """SIGKILL the worker of the replica that lent blocks, once its KV_LENT is published."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        lent = [actor for actor, event in all_events(llm.engine.query_metrics) if isinstance(event, KvLent)]
        if lent:
            victim = "worker-0@" + lent[0].rsplit("@", 1)[1]
            os.kill(pids[victim], signal.SIGKILL)
            killed.append(victim)
            return
        time.sleep(0.01)
