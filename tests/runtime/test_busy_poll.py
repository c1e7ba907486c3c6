"""Busy polling of engine actors (runtime/busy_poll.py): on for CUDA engines, off on the CPU, the
environment variable overriding both; a shell that busy-polls still gets every message, in order."""

from __future__ import annotations

import pytest
import zmq

from vllm_actors.runtime.busy_poll import BUSY_POLL_ENV, DEFAULT_BUSY_POLL_MS, busy_poll_seconds
from vllm_actors.runtime.zmq_shell import ZmqEndpoint

ON = DEFAULT_BUSY_POLL_MS / 1000


def test_on_for_cuda_off_for_cpu() -> None:
    assert busy_poll_seconds("cuda", environ={}) == ON
    assert busy_poll_seconds("cuda:1", environ={}) == ON
    assert busy_poll_seconds("cpu", environ={}) == 0.0


def test_auto_follows_the_driver_and_visible_devices() -> None:
    assert busy_poll_seconds("auto", environ={}, has_nvidia_driver=True) == ON
    assert busy_poll_seconds("auto", environ={}, has_nvidia_driver=False) == 0.0
    assert busy_poll_seconds("auto", environ={"CUDA_VISIBLE_DEVICES": ""}, has_nvidia_driver=True) == 0.0


def test_the_environment_overrides() -> None:
    assert busy_poll_seconds("cuda", environ={BUSY_POLL_ENV: "0"}) == 0.0
    assert busy_poll_seconds("cpu", environ={BUSY_POLL_ENV: "5"}) == 0.005
    with pytest.raises(ValueError, match=BUSY_POLL_ENV):
        busy_poll_seconds("cpu", environ={BUSY_POLL_ENV: "fast"})


def test_a_busy_polling_shell_gets_every_message_in_order(tmp_path) -> None:  # noqa: ANN001
    from vllm_actors.protocol.messages import AbortRequests
    from vllm_actors.runtime.zmq_shell import ActorShell

    context = zmq.Context()
    inbox, bus = f"ipc://{tmp_path}/inbox", f"ipc://{tmp_path}/bus"
    shell = ActorShell(context, object(), "scheduler", inbox, bus, {}, {AbortRequests: None})  # type: ignore[arg-type]
    shell.busy_poll_s = 60.0  # never falls back to blocking during the test
    sender = ZmqEndpoint(context, "client", f"ipc://{tmp_path}/client", {"scheduler": [inbox]})
    try:
        for index in range(50):
            sender.send("scheduler", AbortRequests(request_ids=[f"r{index}"]))
        seen: list[str] = []
        while len(seen) < 50:
            message = shell._next_message()  # returns at once, with a message or None
            if message is not None:
                assert isinstance(message, AbortRequests)
                seen.extend(message.request_ids)
        assert seen == [f"r{index}" for index in range(50)]
        assert shell._last_message_at > 0  # the busy window runs from the last message
    finally:
        for socket in (shell.endpoint.router, sender.router, shell.publisher.socket,
                       *[s for sockets in sender.peers.values() for s in sockets]):
            socket.close(0)
        context.term()
