"""The client-side recovery tests' environment: the ``env`` fixture (a fake scheduler on a real
socket, a fake process group, a group's addresses and the tiny tokenizer; tests/clients/conftest.py
and fake_served.py share it), a fake bus publishing the supervisor's events, and the prompts sent."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.support.fake_scheduler import MAX_MODEL_LEN, Env, FakeGroup, FakeScheduler
from tests.support.tiny_models import build_tokenizer
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer
from vllm_actors.protocol.events import Event, EventBatch
from vllm_actors.runtime.run_dir import GroupInfo, make_addresses


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return load_tokenizer(path)


@pytest.fixture
def env(tokenizer: Tokenizer) -> Iterator[Env]:
    run_dir = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # IPC paths must stay short
    addresses = make_addresses(run_dir, 1)
    info = GroupInfo(pid=os.getpid(), run_dir=str(run_dir), model="fake", addresses=addresses,
                     worker={"eos_token_ids": [tokenizer.eos_token_id], "vocab_size": tokenizer.vocab_size},
                     max_model_len=MAX_MODEL_LEN, tokenizer=None)
    scheduler = FakeScheduler(addresses.scheduler)
    try:
        yield Env(scheduler, FakeGroup(), info, tokenizer)
    finally:
        scheduler.close()
        shutil.rmtree(run_dir, ignore_errors=True)


PROMPTS = [[310 + i, 320, 330 + i] for i in range(3)]


class FakeBus:
    """The bus's publishing side as clients see it (XPUB bound at bus_out), for supervisor events."""

    def __init__(self, address: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = itertools.count()

    def publish(self, topic: str, events: list[Event], actor: str | None = None) -> None:
        batch = EventBatch(actor=actor or topic, first_seq=next(self._seq), mono=time.monotonic(), wall=time.time(),
                           events=events)
        self.socket.send_multipart([topic.encode(), self._encoder.encode(batch)])

    def close(self) -> None:
        self.socket.close()

