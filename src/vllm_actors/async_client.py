"""Compatibility: the asyncio client lives in ``vllm_actors.clients.async_client``."""

from vllm_actors.clients.async_client import AsyncEngineClient, EngineDeadError, RequestStream

__all__ = ["AsyncEngineClient", "EngineDeadError", "RequestStream"]
