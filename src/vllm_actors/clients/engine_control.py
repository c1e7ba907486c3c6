"""Engine commands (``EngineControl``): each sent with a fresh id and waited for until the
scheduler's ``ControlReply`` of that id comes back on the client's connection; an asyncio client
awaits it (``ControlCalls``), a sync client polls for it (``SyncClient.control``). ``check_control``
refuses a bad command before it is sent, with the scheduler's own words.

    reply = await client.control("sleep", level=1)      # AsyncEngineClient.control
    reply = llm.engine.control("wake_up", tags=None)    # SyncClient.control
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from vllm_actors.actors.scheduler.controls import control_error
from vllm_actors.protocol.messages import ControlReply, EngineControl

CONTROL_TIMEOUT = 600.0  # a wake-up reloads the weights and captures the CUDA graphs again


def new_control(action: str, **fields: Any) -> EngineControl:
    """A command with a fresh id; a bad one (unknown action, level, mode or tag) is a ValueError."""
    control = EngineControl(control_id=f"ctl-{secrets.token_hex(8)}", action=action, **fields)
    error = control_error(control)
    if error is not None:
        raise ValueError(error)
    return control


def checked_reply(reply: ControlReply) -> ControlReply:
    """The reply, or the engine's failure to carry the command out as a RuntimeError."""
    if reply.error is not None:
        raise RuntimeError(f"the engine did not carry the command out: {reply.error}")
    return reply


class ControlCalls:
    """The commands awaiting their answer, by id."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[ControlReply]] = {}

    def make(self, action: str, **fields: Any) -> tuple[EngineControl, asyncio.Future[ControlReply]]:
        """A command with a fresh id (``new_control``), and the future its answer resolves."""
        control = new_control(action, **fields)
        future: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._waiting[control.control_id] = future
        return control, future

    async def wait(self, control: EngineControl, future: asyncio.Future[ControlReply],
                   timeout: float = CONTROL_TIMEOUT) -> ControlReply:
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise TimeoutError(f"the engine did not answer {control.action!r} within {timeout:.0f} s") from None
        finally:
            self._waiting.pop(control.control_id, None)

    def resolve(self, reply: ControlReply) -> None:
        future = self._waiting.pop(reply.control_id, None)
        if future is not None and not future.done():
            future.set_result(reply)

    def fail_all(self, error: BaseException) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()
