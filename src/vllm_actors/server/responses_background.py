"""Background responses (``background: true``), as vLLM runs them: the request runs in a task of
its own, the stored response says how it stands (``queued``, ``in_progress``, then as it ended),
and ``POST /v1/responses/{id}/cancel`` aborts it. A background response created with ``stream:
true`` keeps its events in an ``EventLog``: the creating request streams them from the first, and
``GET /v1/responses/{id}?stream=true&starting_after=N`` replays them from sequence number N + 1 and
follows the live ones, however often a client reconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import structlog

from vllm_actors.server.errors import OpenAIError, bad_request, log_edge_error

log = structlog.get_logger(__name__)

Event = dict[str, Any]


class EventLog:
    """One background response's events in order (an event's index is its ``sequence_number``),
    closed when its task ends however it ends; readers wait for the next one."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, event: Event) -> None:
        self.events.append(event)
        self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def replay(self, starting_after: int | None = None) -> AsyncIterator[Event]:
        """The events after sequence number ``starting_after`` (all when None), then each new one
        as it comes, until the log is closed."""
        index = 0 if starting_after is None else starting_after + 1
        while True:
            self._changed.clear()
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.closed:
                return
            await self._changed.wait()


def check_starting_after(starting_after: int | None) -> None:
    if starting_after is not None and starting_after < 0:
        raise bad_request(f"starting_after: must be a sequence number (>= 0), got {starting_after}",
                          "starting_after")


def unknown_events(response_id: str) -> OpenAIError:
    """vLLM's refusal to stream a response that has no events kept (not created with
    ``background`` and ``stream`` both true)."""
    return bad_request(f"Unknown response_id: {response_id} (only a response created with background and stream "
                       "true can be streamed again)", "response_id")


async def log_events(events: AsyncIterator[Event], log_to: EventLog, response_id: str) -> None:
    """A background stream's task: each event into ``log_to``, which is closed at the end (ended,
    failed or cancelled), so that its readers stop."""
    try:
        async for event in events:
            log_to.append(event)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # the task has nobody to answer: the readers get an error event
        log_edge_error("background response stream failed", {"path": "/v1/responses"}, error)
        log_to.append({"type": "error", "sequence_number": len(log_to.events), "code": "500",
                       "message": type(error).__name__, "param": None})
    finally:
        log_to.close()
        log.debug("background response stream ended", request_id=response_id, events=len(log_to.events))
