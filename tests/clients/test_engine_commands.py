"""vLLM's named engine commands on the asyncio client (``AsyncEngineCommands``: sleep, wake_up,
is_sleeping, reset_prefix_cache) map onto one ``EngineControl`` each and raise when the engine
could not carry one out; a bad command is a ValueError before anything is sent. (The sync client's
and ``LLM``'s run on real engines in tests/engine/test_llm_api.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_actors.clients.engine_commands import AsyncEngineCommands
from vllm_actors.clients.engine_control import new_control
from vllm_actors.protocol.messages import ControlReply


class Recorded(AsyncEngineCommands):
    def __init__(self, reply: ControlReply) -> None:
        self.reply = reply
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def control(self, action: str, **fields: Any) -> ControlReply:
        new_control(action, **fields)  # as the client does: checked before it is sent
        self.sent.append((action, fields))
        return self.reply


@pytest.mark.asyncio
async def test_each_command_is_one_engine_control_with_vllms_arguments() -> None:
    engine = Recorded(ControlReply(control_id="c", success=False, is_sleeping=True))
    await engine.sleep(level=2, mode="wait")
    await engine.wake_up(tags=["weights"])
    assert await engine.is_sleeping() is True
    assert await engine.reset_prefix_cache(reset_running_requests=True) is False  # requests still hold blocks
    assert engine.sent == [("sleep", {"level": 2, "mode": "wait"}), ("wake_up", {"tags": ["weights"]}),
                           ("is_sleeping", {}), ("reset_prefix_cache", {"reset_running_requests": True})]


@pytest.mark.asyncio
async def test_a_bad_command_or_a_failed_one_raises() -> None:
    engine = Recorded(ControlReply(control_id="c", error="the worker could not offload"))
    with pytest.raises(ValueError, match="mode: must be one of abort, wait, keep, got 'later'"):
        await engine.sleep(mode="later")
    with pytest.raises(RuntimeError, match="the worker could not offload"):
        await engine.sleep()
    assert engine.sent == [("sleep", {"level": 1, "mode": "abort"})]
