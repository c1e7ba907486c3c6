"""The fakes behind the client-side tests: a scheduler on a real ROUTER socket (one token per
request per tick; it can crash, restart, be paced one step at a time or held at n outputs), the
supervisor's contract for the clients (a fake process group), and ``Env``, which holds them with a
group's addresses and a tokenizer (the ``env`` fixture of fake_env.py, which tests/clients,
fake_served.py and the HTTP-edge tests share)."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from vllm_actors.actors.frontend.tokenizer import Tokenizer
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.messages import AbortRequests, AddRequest, Message, RequestUpdate, RequestUpdates
from vllm_actors.runtime.run_dir import GroupInfo

MAX_MODEL_LEN = 256


def token_at(prompt: Sequence[int], position: int) -> int:
    """The fake model: output token ``position`` of a prompt (so a resumed request goes on exactly)."""
    return 300 + (sum(prompt) * 7 + position * 13) % 200


def expected_tokens(prompt: list[int], count: int) -> list[int]:
    return [token_at(prompt, i) for i in range(count)]


@dataclass
class _Running:
    identity: bytes
    add: AddRequest
    outputs: list[int]


class FakeScheduler:
    """A scheduler on a real ROUTER socket: one token per request per tick, ``length`` at max_tokens.
    ``crash()`` drops every request and everything that arrives until ``restart()`` (a fresh
    scheduler then knows nothing); a resubmission of a request it holds is ignored. After
    ``pace()`` it steps only when the test ``allow``s it, one step per permit; after ``hold_at(n)``
    no request goes past n outputs until ``release()`` (so a test that acts mid-generation never
    races the generation, however slow the machine)."""

    TICK = 0.005

    def __init__(self, address: str) -> None:
        self.address = address
        self.lock = threading.Lock()
        self.requests: dict[str, _Running] = {}
        self.received: list[AddRequest] = []
        self.down = False
        self._permits: int | None = None  # None: a step every tick
        self._hold: int | None = None  # no request makes more outputs than this
        self._script: list[int] | None = None  # the tokens every request makes instead of token_at's
        self.steps_sent = 0  # steps whose updates have gone out
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._bound.wait(10)

    def progress(self, request_id: str) -> int:
        with self.lock:
            running = self.requests.get(request_id)
            return len(running.outputs) if running is not None else 0

    def resumed(self) -> dict[str, list[int]]:
        with self.lock:
            return {a.request_id: a.output_token_ids for a in self.received if a.resume}

    def pace(self) -> None:
        with self.lock:
            self._permits = 0

    def hold_at(self, outputs: int) -> None:
        with self.lock:
            self._hold = outputs

    def script(self, token_ids: list[int]) -> None:
        """Every request's output token ``i`` is ``token_ids[i]`` from now on (a model whose output the
        test chooses: a token of no text of its own, say)."""
        with self.lock:
            self._script = list(token_ids)

    def release(self) -> None:
        with self.lock:
            self._hold = None

    def allow(self, steps: int = 1) -> None:
        with self.lock:
            self._permits = (self._permits or 0) + steps

    def crash(self) -> None:
        with self.lock:
            self.down = True
            self.requests.clear()

    def restart(self) -> None:
        with self.lock:
            self.down = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.address)
        self._bound.set()
        codec = MessageCodec()
        try:
            while not self._stop.is_set():
                if socket.poll(int(self.TICK * 1000)):
                    while True:
                        try:
                            identity, payload = socket.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(identity, codec.decode(payload))
                stepped = self._step()
                for identity, items in stepped.items():
                    socket.send_multipart([identity, codec.encode(RequestUpdates(step_id=0, updates=items))])
                if stepped:
                    with self.lock:
                        self.steps_sent += 1
        finally:
            socket.close()
            context.term()

    def _on_message(self, identity: bytes, message: Message) -> None:
        with self.lock:
            if self.down:
                return  # lost with the dead scheduler
            if isinstance(message, AddRequest):
                self.received.append(message)
                if message.resume and message.request_id in self.requests:
                    return
                self.requests[message.request_id] = _Running(identity, message, list(message.output_token_ids))
            elif isinstance(message, AbortRequests):
                for request_id in message.request_ids:
                    self.requests.pop(request_id, None)

    def _step(self) -> dict[bytes, list[RequestUpdate]]:
        out: dict[bytes, list[RequestUpdate]] = defaultdict(list)
        with self.lock:
            if self.down or not self.requests or self._permits == 0:
                return out
            if self._permits is not None:
                self._permits -= 1
            for request_id, running in list(self.requests.items()):
                if self._hold is not None and len(running.outputs) >= self._hold:
                    continue
                position = len(running.outputs)
                script = self._script
                token = script[position] if script else token_at(running.add.prompt_ids(), position)
                running.outputs.append(token)
                done = len(running.outputs) >= (running.add.params.max_tokens or 0)
                out[running.identity].append(RequestUpdate(request_id=request_id, new_token_ids=[token],
                                                           finish_reason="length" if done else None))
                if done:
                    del self.requests[request_id]
        return out


class FakeGroup:
    """The supervisor's contract as ``clients/supervision.py`` reads it, driven by the test:
    ``restart`` and ``fail`` call the listeners from a thread of their own."""

    ACTORS = ("bus", "metrics", "worker-0", "kv_cache_manager", "scheduler")

    def __init__(self) -> None:
        self.states = dict.fromkeys(self.ACTORS, "ready")
        self.processes = dict.fromkeys(self.ACTORS, True)
        self.failed: str | None = None
        self.restart_listeners: list[Callable[[str], None]] = []
        self.failure_listeners: list[Callable[[str], None]] = []
        self.config = types.SimpleNamespace(max_num_seqs=256)
        self.stopped = False

    def on_restart(self, callback: Callable[[str], None]) -> None:
        self.restart_listeners.append(callback)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self.failure_listeners.append(callback)

    def state(self) -> dict[str, str]:
        return dict(self.states)

    def alive(self) -> dict[str, bool]:
        return dict(self.processes)

    def shutdown(self) -> None:
        self.stopped = True

    def restart(self, actor: str) -> None:
        self.states[actor] = "ready"
        self._in_thread(self.restart_listeners, actor)

    def fail(self, reason: str) -> None:
        self.failed = reason
        self.states = dict.fromkeys(self.ACTORS, "failed")
        self._in_thread(self.failure_listeners, reason)

    @staticmethod
    def _in_thread(listeners: list[Callable[[str], None]], argument: str) -> None:
        thread = threading.Thread(target=lambda: [listener(argument) for listener in listeners])
        thread.start()
        thread.join()


@dataclass
class Env:
    scheduler: FakeScheduler
    group: FakeGroup
    info: GroupInfo
    tokenizer: Tokenizer


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


async def wait_until_async(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)
