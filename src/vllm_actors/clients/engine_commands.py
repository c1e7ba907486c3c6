"""vLLM's named engine commands on the clients: ``sleep``, ``wake_up``, ``is_sleeping`` and
``reset_prefix_cache``, each one ``EngineControl`` (``control``) answered by the engine, with vLLM's
signatures (``LLMEngine`` and ``AsyncLLM``). The sync mixin serves ``SyncClient`` (and through it
``LLM``), the async one ``AsyncEngineClient``.

Sleep as the scheduler defines it (``actors/scheduler/controls.py``): level 0 pauses scheduling;
levels 1 and 2 also put the weights (offloaded to host memory at 1, discarded at 2) and the KV cache
(discarded) to sleep; ``mode`` says what becomes of requests in flight ("abort", "wait", "keep").
Requests sent while asleep wait for the wake-up."""

from __future__ import annotations

from typing import Any

from vllm_actors.clients.engine_control import CONTROL_TIMEOUT, checked_reply
from vllm_actors.protocol.messages import ControlReply


class SyncEngineCommands:
    """Named commands over a blocking ``control``."""

    def control(self, action: str, timeout: float = CONTROL_TIMEOUT, **fields: Any) -> ControlReply:
        """Sent and answered; raises when the engine could not carry it out (the client's)."""
        raise NotImplementedError

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.control("sleep", level=level, mode=mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what ``tags`` names ("weights", "kv_cache", "scheduling"; None: everything)."""
        self.control("wake_up", tags=tags)

    def is_sleeping(self) -> bool:
        return self.control("is_sleeping").is_sleeping

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Empty the prefix cache (the host tier too); False while requests hold blocks, unless
        ``reset_running_requests`` preempts them first. ``reset_connector``: there is no KV
        connector here, nothing more to reset."""
        return self.control("reset_prefix_cache", reset_running_requests=reset_running_requests).success


class AsyncEngineCommands:
    """Named commands over an awaited ``control``."""

    async def control(self, action: str, **fields: Any) -> ControlReply:
        """Sent and answered; the reply says whether it was carried out (the client's)."""
        raise NotImplementedError

    async def _command(self, action: str, **fields: Any) -> ControlReply:
        return checked_reply(await self.control(action, **fields))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self._command("sleep", level=level, mode=mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._command("wake_up", tags=tags)

    async def is_sleeping(self) -> bool:
        return (await self._command("is_sleeping")).is_sleeping

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        reply = await self._command("reset_prefix_cache", reset_running_requests=reset_running_requests)
        return reply.success
