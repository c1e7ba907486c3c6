"""One error path in the actor shells: a message that fails validation is rejected whole (logged,
REJECTED on the bus, the actor keeps serving); any other exception out of a state machine is a bug
that crashes the actor (CRASHED on the bus, the exception propagates)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import ActorCrashed, Allocated, Rejected
from vllm_actors.protocol.messages import NewRequest, StepPlan
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids
from vllm_actors.runtime.zmq_shell import ActorShell

SCHEDULER = b"scheduler"


class RecordingPublisher:
    """Stands in for the bus: keeps every batch of events the shell publishes."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, events: list[Any]) -> None:
        self.events.extend(events)

    def close(self) -> None:
        pass


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


def make_shell(context: zmq.Context, tmp_path: Path, actor: Any, peers: dict[str, list[str]]) -> ActorShell:
    shell = ActorShell(context, actor, "kv_cache_manager", f"ipc://{tmp_path}/inbox", f"ipc://{tmp_path}/bus",
                       peers, {StepPlan: frozenset({SCHEDULER})})
    shell.publisher.close()
    shell.publisher = RecordingPublisher()  # type: ignore[assignment]
    return shell


def new_request(request_id: str, num_tokens: int) -> NewRequest:
    return NewRequest(request_id=request_id, token_ids=pack_token_ids(range(num_tokens)), num_prompt_tokens=num_tokens,
                      num_output_tokens=0, params=SamplingParams(), eos_token_ids=[0])


def kv_state(manager: KVCacheManager) -> tuple:
    return (dict(manager.block_tables), manager.pool.num_free, dict(manager.cached), dict(manager.num_cached_front))


def test_the_kv_manager_rejects_a_disagreeing_plan_whole_and_keeps_serving(zmq_context: zmq.Context,
                                                                            tmp_path: Path) -> None:
    worker = zmq_context.socket(zmq.ROUTER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.bind(f"ipc://{tmp_path}/worker")
    manager = KVCacheManager(num_blocks=8, block_size=4)
    shell = make_shell(zmq_context, tmp_path, manager, {"worker": [f"ipc://{tmp_path}/worker"]})
    codec = MessageCodec()
    try:
        shell.receive(SCHEDULER, StepPlan(step_id=0, new_requests=[new_request("a", 12)], req_ids=["a"],
                                          num_tokens=[12], num_blocks=[3]))
        assert worker.poll(5000)
        assert codec.decode(worker.recv_multipart()[1]).new_block_ids == [[0, 1, 2]]
        before = kv_state(manager)
        shell.publisher.events.clear()

        # "a" grows by 2 blocks and the new "c" wants 4: 6 > 5 free. Checked
        # first, so a's table does not grow, nothing is freed and c gets no table.
        too_big = StepPlan(step_id=1, new_requests=[new_request("c", 16)], req_ids=["a", "c"], num_tokens=[1, 16],
                           num_blocks=[5, 4])
        with pytest.raises(MessageRejected, match="needs 6 blocks"):
            manager.handle(too_big)  # the rejection type, a ValueError
        shell.receive(SCHEDULER, too_big)
        assert kv_state(manager) == before
        assert shell.publisher.events == [
            Rejected(message_type="StepPlan", sender="scheduler", error="the plan needs 6 blocks, 5 free")
        ]
        assert not worker.poll(100)  # nothing forwarded
        evicts_uncached = StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[4], evicted_hashes=[42])
        shell.receive(SCHEDULER, evicts_uncached)
        assert kv_state(manager) == before
        assert isinstance(shell.publisher.events[-1], Rejected) and "not cached" in shell.publisher.events[-1].error
        assert shell.num_dropped == 2

        # still serving: a plan that fits goes through to the worker
        shell.receive(SCHEDULER, StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[4]))
        assert worker.poll(5000)
        assert codec.decode(worker.recv_multipart()[1]).new_block_ids == [[3]]
        assert any(isinstance(event, Allocated) for event in shell.publisher.events)
        manager.check_invariants()
    finally:
        shell.close()
        worker.close()


class BuggyActor:
    """A state machine with a bug: every message hits a missing key."""

    name = "kv_cache_manager"

    def __init__(self) -> None:
        self.table: dict[str, int] = {}

    def handle(self, message: Any) -> list[tuple[str, Any]]:
        return [("worker", self.table["missing"])]


def test_a_bug_in_a_state_machine_crashes_the_actor_with_crashed_on_the_bus(zmq_context: zmq.Context,
                                                                             tmp_path: Path) -> None:
    shell = make_shell(zmq_context, tmp_path, BuggyActor(), {})
    scheduler = zmq_context.socket(zmq.DEALER)
    scheduler.setsockopt(zmq.IDENTITY, SCHEDULER)
    scheduler.setsockopt(zmq.LINGER, 0)
    scheduler.connect(f"ipc://{tmp_path}/inbox")
    try:
        with pytest.raises(KeyError):  # not swallowed as a rejection
            shell.receive(SCHEDULER, StepPlan(step_id=0))
        assert shell.publisher.events == []  # receive alone does not publish: run does, then re-raises
        scheduler.send(MessageCodec().encode(StepPlan(step_id=0)))
        stop = threading.Event()
        timer = threading.Timer(10.0, stop.set)  # the loop must end by the crash, not by this
        timer.start()
        try:
            with pytest.raises(KeyError, match="missing"):
                shell.run(stop)
        finally:
            timer.cancel()
        assert not stop.is_set()
        assert shell.publisher.events == [ActorCrashed(error="KeyError: 'missing'")]
    finally:
        scheduler.close()
        shell.close()


# --------------------------------------------------------------------------- one loop, both transports
def test_only_the_roles_clients_connect_to_screen_request_ids(zmq_context: zmq.Context, tmp_path: Path) -> None:
    from vllm_actors.protocol.names import CONTROLLER
    from vllm_actors.protocol.names import SCHEDULER as SCHEDULER_ROLE
    from vllm_actors.runtime.roles import ROLES

    assert {name for name, role in ROLES.items() if role.clients_connect} == {SCHEDULER_ROLE, CONTROLLER}
    shell = make_shell(zmq_context, tmp_path, KVCacheManager(num_blocks=8, block_size=4), {})
    try:
        assert shell.loop.owners is None  # the KV-cache manager's shell keeps no request owners
    finally:
        shell.close()


def test_the_publisher_drops_work_events_only_when_told(zmq_context: zmq.Context, tmp_path: Path) -> None:
    from vllm_actors.protocol.events import ActorReady
    from vllm_actors.runtime.zmq_shell import EventPublisher

    allocated = Allocated(request_id="a", block_ids=[0], num_free_blocks=7)
    ready = ActorReady(pid=1, role="kv_cache_manager")
    for drop, expected in ((False, [allocated, ready]), (True, [ready])):
        publisher = EventPublisher(zmq_context, f"ipc://{tmp_path}/bus", "kv_cache_manager", drop_work_events=drop)
        try:
            batch = publisher.publish([allocated, ready])
            assert batch is not None and batch.events == expected
            assert (publisher.publish([allocated]) is None) == drop  # nothing left: no batch
        finally:
            publisher.close()


def test_the_in_process_engine_applies_each_roles_accept_rules_and_request_identity() -> None:
    """The in-process engine runs every actor through the shells' loop: a pipeline reset from
    anyone but the supervisor is dropped, and one client cannot abort or take another's request."""
    from tests.engine.test_engine_prefix_caching import record_events
    from tests.engine.test_scheduler import make_engine
    from vllm_actors.protocol.events import PipelineReset
    from vllm_actors.protocol.messages import AbortRequests, AddRequest, RecoverPipeline, RequestUpdates
    from vllm_actors.protocol.names import SCHEDULER as SCHEDULER_NAME
    from vllm_actors.protocol.names import SUPERVISOR, WORKER

    engine, _ = make_engine(num_blocks=40)
    events = record_events(engine)
    engine.submit(engine.prepare("a", {"prompt_token_ids": [1, 2, 3]},
                                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    engine.step()
    scheduler_endpoint = engine._transports[SCHEDULER_NAME].endpoint
    engine.inject(SCHEDULER_NAME, RecoverPipeline(actor=WORKER, reason="forged"), first=True, sender="intruder")
    engine.step()  # the scheduler reads it first
    assert scheduler_endpoint.num_dropped == 1 and not [e for e in events if isinstance(e, PipelineReset)]

    other = engine._network.endpoint("other")  # a second client connection
    other.send(SCHEDULER_NAME, AbortRequests(request_ids=["a"], reason="abort"))
    other.send(SCHEDULER_NAME, AddRequest(request_id="a", prompt_token_ids=[4], params=SamplingParams(),
                                          eos_token_ids=[0]))
    for _ in range(100):  # a few steps: the scheduler reads its queue one message per round
        if engine._network.inbox("other"):
            break
        engine.step()
    assert engine.has_unfinished  # "a" runs on, untouched
    refusals = [e for e in events if isinstance(e, Rejected)]
    assert [(e.message_type, e.sender) for e in refusals] == [("AbortRequests", "other"), ("AddRequest", "other")]
    reply = other.recv()  # the refused AddRequest is answered to its sender only
    assert isinstance(reply, RequestUpdates) and reply.updates[0].finish_reason == "error"

    engine.inject(SCHEDULER_NAME, RecoverPipeline(actor=WORKER, reason="exited"), sender=SUPERVISOR)
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert [e.reason for e in events if isinstance(e, PipelineReset)] == ["worker: exited"]
    assert outputs[-1].request_id == "a" and outputs[-1].finished and outputs[-1].error is None
    assert len(outputs[-1].outputs[0].token_ids) == 40
