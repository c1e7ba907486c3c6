"""The in-memory and the ZMQ transports honour the same contract."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from vllm_actors.protocol.messages import AbortRequests, AddRequest, StepPlan, StepResult
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime.transport import InMemoryNetwork
from vllm_actors.runtime.zmq_shell import ZmqEndpoint

NAMES = ("a", "b", "c")
MESSAGES = [
    AddRequest(request_id="r1", prompt_token_ids=[1, 2, 3], params=SamplingParams(seed=5, stop=["x"]),
               eos_token_ids=[0]),
    StepPlan(step_id=1, req_ids=["r1"], num_tokens=[3], num_blocks=[1], new_block_ids=[[4]]),
    StepResult(step_id=1, req_ids=["r1"], token_ids=[7]),
    AbortRequests(request_ids=["r1"], reason="abort"),
]


@pytest.fixture(params=["memory", "zmq"])
def endpoints(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict]:
    if request.param == "memory":
        network = InMemoryNetwork(serialize=True)
        yield {name: network.endpoint(name) for name in NAMES}
        return
    context = zmq.Context()
    inbox = {name: f"ipc://{tmp_path}/{name}" for name in NAMES}
    made = {
        name: ZmqEndpoint(context, name, inbox[name], {peer: [inbox[peer]] for peer in NAMES if peer != name})
        for name in NAMES
    }
    yield made
    for endpoint in made.values():
        endpoint.close()
    context.term()


def test_messages_arrive_intact_in_order_at_the_right_endpoint(endpoints: dict) -> None:
    for message in MESSAGES:
        endpoints["a"].send("b", message)
    from_c = AbortRequests(request_ids=["from-c"], reason="disconnect")
    endpoints["c"].send("b", from_c)
    received = [endpoints["b"].recv(timeout_ms=5000) for _ in range(len(MESSAGES) + 1)]
    assert from_c in received
    assert [m for m in received if m != from_c] == MESSAGES  # intact, and one sender's order kept
    assert endpoints["a"].recv(timeout_ms=50) is None
    assert endpoints["c"].recv(timeout_ms=50) is None


def test_nothing_to_receive_gives_none(endpoints: dict) -> None:
    assert endpoints["a"].recv(timeout_ms=10) is None


def test_unknown_destination_raises(endpoints: dict) -> None:
    with pytest.raises(KeyError):
        endpoints["a"].send("nobody", MESSAGES[0])


def test_a_restarted_peer_takes_over_its_identity(tmp_path: Path) -> None:
    """A restarted actor reconnects under its old identity while the receiving ROUTER may still
    hold the dead one's pipe; its messages must arrive (ZMQ drops them without ROUTER_HANDOVER:
    a restarted KV-cache manager's reset plan never reached the worker)."""
    context = zmq.Context()
    address = f"ipc://{tmp_path}/inbox"
    receiver = ZmqEndpoint(context, "worker-0", address, {})
    old = context.socket(zmq.DEALER)
    old.setsockopt(zmq.IDENTITY, b"kv_cache_manager")
    old.setsockopt(zmq.LINGER, 0)
    old.connect(address)
    new = context.socket(zmq.DEALER)
    try:
        codec = receiver.codec
        old.send(codec.encode(AbortRequests(request_ids=["from-old"])))
        assert receiver.recv(timeout_ms=10_000).request_ids == ["from-old"]
        new.setsockopt(zmq.IDENTITY, b"kv_cache_manager")  # the old one is still connected
        new.setsockopt(zmq.LINGER, 0)
        new.connect(address)
        new.send(codec.encode(AbortRequests(request_ids=["from-new"])))
        message = receiver.recv(timeout_ms=10_000)
        assert message is not None and message.request_ids == ["from-new"]
        assert receiver.last_sender == b"kv_cache_manager"
    finally:
        old.close()
        new.close()
        receiver.close()
        context.term()
