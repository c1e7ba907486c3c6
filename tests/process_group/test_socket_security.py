"""Who may talk to a group's sockets: CURVE on every TCP socket, with keys made per
group and handed over in the run directory (``runtime/security.py``); IPC socket files 0600 in a
private directory; a metrics-store dump never written where a query says.

The claims about an attacker are absences ("nothing gets through"): each attacker socket first
waits (bounded) for the handshake to fail, which ZMQ reports on a monitor socket, and fails at once
if a handshake ever succeeds; only then is the absence of any delivery checked, with a bounded wait
on the attacker's side, while the group keeps serving a keyed client.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_actors import SamplingParams
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import EventBatch, Heartbeat
from vllm_actors.protocol.messages import AddRequest
from vllm_actors.protocol.metrics import (
    DumpQuery,
    MetricsCodec,
    SeenQuery,
    SeenReply,
    SummaryQuery,
    TimelineQuery,
    TimelineReply,
)
from vllm_actors.runtime.security import KEYS_FILE, GroupKeys, authenticating, bind, connect, keys_for
from vllm_actors.runtime.supervisor import ProcessGroup

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_WAIT = 30.0  # seconds an attacker's refusal may take to be reported (a loaded machine)
QUIET_MS = 500  # how long an attacker socket is watched for anything arriving, once refused

# How an attacker tries: no CURVE at all; CURVE with keys of its own; CURVE with the group's server
# key (as if the "public" key had leaked) but a client key of its own.
ATTACKS = ("plain", "own keys", "server key only")

_monitors = itertools.count()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sec", dir="/tmp"))  # ipc paths are limited to ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Attacker:
    """One socket of a peer without the group's client key, with a monitor of its handshakes."""

    def __init__(self, context: zmq.Context, kind: int, address: str, attack: str, server_public: str) -> None:
        self.address, self.attack = address, attack
        self.socket = context.socket(kind)
        self.socket.setsockopt(zmq.LINGER, 0)
        # a refused peer reconnects, and every retry reports another handshake outcome: at most one a
        # second, so that the monitor's pipe cannot fill during a slow test (see close)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 1000)
        self.monitor = self.socket.get_monitor_socket(HANDSHAKE_EVENTS, addr=f"inproc://attack-{next(_monitors)}")
        if attack != "plain":
            public, secret = zmq.curve_keypair()
            server = server_public.encode() if attack == "server key only" else public
            self.socket.setsockopt(zmq.CURVE_SERVERKEY, server)
            self.socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
        if kind == zmq.SUB:
            self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(address)

    def wait_refused(self) -> None:
        """Until the handshake fails (bounded); a handshake that succeeds fails the test."""
        outcome = self.monitor.poll(int(HANDSHAKE_WAIT * 1000))
        assert outcome, f"no handshake outcome for {self.attack} at {self.address}"
        event = recv_monitor_message(self.monitor)["event"]  # only handshake outcomes are monitored
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, f"{self.attack} got through at {self.address}"

    def close(self) -> None:
        # Disabling a monitor takes the lock under which libzmq's I/O thread sends it events, with a
        # blocking send: were the pipe full of unread handshake outcomes, neither would ever return
        # (a CI run hung here, most likely so). Drain it first.
        while self.monitor.poll(0):
            self.monitor.recv_multipart()
        self.socket.disable_monitor()
        self.monitor.close()
        self.socket.close()


def _nothing_arrives(attackers: list[Attacker]) -> None:
    poller = zmq.Poller()
    for attacker in attackers:
        poller.register(attacker.socket, zmq.POLLIN)
    ready = dict(poller.poll(QUIET_MS))
    assert not ready, [f"{a.attack} at {a.address}" for a in attackers if a.socket in ready]


# --------------------------------------------------------------------------- the pieces, in process
def test_the_key_file_is_private_and_secret_keys_never_print(short_dir: Path) -> None:
    keys = GroupKeys.generate()
    path = keys.save(short_dir)
    assert path == short_dir / KEYS_FILE and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert GroupKeys.load(short_dir) == keys
    assert keys.server_secret not in repr(keys) and keys.client_secret not in str(keys)
    with pytest.raises(FileExistsError):  # never over an existing file
        keys.save(short_dir)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError):  # a key file others may read is not trusted
        GroupKeys.load(short_dir)


def test_ipc_socket_files_are_0600_in_a_private_directory(short_dir: Path) -> None:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    try:
        bind(router, f"ipc://{short_dir}/inbox", None)
        assert stat.S_IMODE((short_dir / "inbox").stat().st_mode) == 0o600
        os.chmod(short_dir, 0o755)
        with pytest.raises(PermissionError):  # a directory others can enter is no place for sockets
            bind(context.socket(zmq.ROUTER), f"ipc://{short_dir}/other", None)
        assert not (short_dir / "other").exists()
    finally:
        context.destroy(linger=0)


def test_tcp_needs_the_keys_and_a_zap_handler() -> None:
    context = zmq.Context()
    try:
        with pytest.raises(PermissionError, match="CURVE keys"):
            connect(context.socket(zmq.DEALER), "tcp://127.0.0.1:9", None)
        with pytest.raises(RuntimeError, match="ZAP handler"):  # a CURVE server that would let anyone in
            bind(context.socket(zmq.ROUTER), "tcp://127.0.0.1:*", GroupKeys.generate())
    finally:
        context.destroy(linger=0)


def test_curve_lets_the_group_client_in_and_nobody_else() -> None:
    keys = GroupKeys.generate()
    server_context, client_context = zmq.Context(), zmq.Context()
    attackers: list[Attacker] = []
    try:
        with authenticating(server_context, keys):
            router = server_context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            bind(router, "tcp://127.0.0.1:*", keys)
            address = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            attackers = [Attacker(client_context, zmq.DEALER, address, attack, keys.server_public)
                         for attack in ATTACKS]
            for attacker in attackers:
                attacker.socket.send(b"let me in")
            client = client_context.socket(zmq.DEALER)
            client.setsockopt(zmq.LINGER, 0)
            connect(client, address, keys)
            client.send(b"hello")
            assert router.poll(30_000)
            identity, payload = router.recv_multipart()
            assert payload == b"hello"
            router.send_multipart([identity, b"welcome"])
            assert client.poll(30_000) and client.recv() == b"welcome"
            for attacker in attackers:
                attacker.wait_refused()
            assert not router.poll(QUIET_MS)  # nothing of theirs was delivered
            router.close()
    finally:
        for attacker in attackers:
            attacker.close()
        client_context.destroy(linger=0)
        server_context.destroy(linger=0)


# --------------------------------------------------------------------------- a group on loopback TCP
@pytest.fixture(scope="module")
def tcp_group(tiny_qwen3: Path) -> Iterator[ProcessGroup]:
    config = EngineConfig(model=str(tiny_qwen3), num_gpu_blocks_override=32)
    with ProcessGroup(config, tcp_host="127.0.0.1") as group:
        yield group


def _generate(group: ProcessGroup, request_id: str, max_tokens: int = 4) -> list[int]:
    from vllm_actors.clients.sync_client import EngineClient

    client = EngineClient(group.info)
    try:
        client.submit(client.prepare(request_id, {"prompt_token_ids": [5, 6, 7]},
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            finished = [output for output in client.poll(100) if output.finished]
            if finished:
                return list(finished[0].outputs[0].token_ids)
        raise AssertionError(f"{request_id} did not finish")
    finally:
        client.close()


def _targets(group: ProcessGroup) -> list[tuple[int, str]]:
    addresses = group.addresses
    routers = [addresses.scheduler, addresses.kv_cache_manager, *addresses.workers, addresses.metrics]
    bus_inputs = [addresses.bus_in, *addresses.bus_in_actors.values()]
    return ([(zmq.DEALER, address) for address in routers] + [(zmq.PUB, address) for address in bus_inputs]
            + [(zmq.SUB, addresses.bus_out)])


def _attack_frames(group: ProcessGroup, kind: int, address: str, request_id: str) -> list[list[bytes]]:
    """What an attacker would send there: a request, metrics queries (one a dump), forged events
    (a subscriber only subscribes)."""
    if kind == zmq.SUB:
        return []
    if kind == zmq.PUB:
        batch = msgspec.msgpack.encode(EventBatch(actor="frontend-attacker", first_seq=0, mono=0.0, wall=0.0,
                                                  events=[Heartbeat(pid=1)]))
        return [[b"frontend-attacker", batch], [b"scheduler", batch]]
    if address == group.addresses.metrics:
        codec = MetricsCodec()
        return [[codec.encode(SummaryQuery())], [codec.encode(DumpQuery())],
                [msgspec.msgpack.encode({"type": "dump_query", "path": "/tmp/chosen-by-the-attacker"})]]
    add = AddRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4),
                     eos_token_ids=[])
    return [[MessageCodec().encode(add)]]


def test_without_the_key_nothing_gets_through_any_tcp_socket(tcp_group: ProcessGroup) -> None:
    assert tcp_group.keys is not None
    assert stat.S_IMODE((tcp_group.run_dir / KEYS_FILE).stat().st_mode) == 0o600
    context = zmq.Context()
    attackers: list[Attacker] = []
    try:
        for (kind, address), attack in itertools.product(_targets(tcp_group), ATTACKS):
            attacker = Attacker(context, kind, address, attack, tcp_group.keys.server_public)
            attackers.append(attacker)
            for frames in _attack_frames(tcp_group, kind, address, f"attack-{len(attackers)}"):
                try:  # queued on the pipe connect() made; a refused handshake may already have torn it down
                    attacker.socket.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # then there is no pipe to queue on (a blocking send would wait for ever): nothing goes out
        for attacker in attackers:
            attacker.wait_refused()
        # The group serves a keyed client meanwhile: tokens come back, events flow on the bus.
        assert len(_generate(tcp_group, "keyed-after-attack")) == 4
        _nothing_arrives(attackers)  # no reply, no event, no query answer
    finally:
        for attacker in attackers:
            attacker.close()
        context.destroy(linger=0)
    # Nothing the attackers sent was taken in: no request, no event under their id, no dump.
    from vllm_actors.observe.tap import query_metrics

    keys = keys_for(tcp_group.addresses, tcp_group.run_dir)
    seen = query_metrics(tcp_group.addresses.metrics, SeenQuery(), keys=keys)
    assert isinstance(seen, SeenReply) and "frontend-attacker" not in seen.actors
    for request_id in (f"attack-{n}" for n in range(1, len(attackers) + 1)):
        timeline = query_metrics(tcp_group.addresses.metrics, TimelineQuery(request_id=request_id), keys=keys)
        assert isinstance(timeline, TimelineReply) and timeline.events == [], request_id
    assert not list(tcp_group.run_dir.glob("events-*.jsonl")) and not Path("/tmp/chosen-by-the-attacker").exists()
    assert set(tcp_group.state().values()) == {"ready"}


def test_a_keyed_async_client_generates_over_tcp(tcp_group: ProcessGroup) -> None:
    from vllm_actors.clients.async_client import AsyncEngineClient

    async def run() -> list[int]:
        client = await AsyncEngineClient.attach(tcp_group.info)  # its bus round trip: publisher, store, bus
        try:
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            final: Any = None
            async for output in client.generate({"prompt_token_ids": [9, 10, 11]}, params, "async-tcp"):
                final = output
            assert (await client.check_health()) == {}
            return list(final.outputs[0].token_ids)
        finally:
            await client.shutdown()

    assert len(asyncio.run(asyncio.wait_for(run(), 120))) == 5


def test_stats_and_a_dump_over_tcp_from_the_command_line(tcp_group: ProcessGroup, tmp_path: Path) -> None:
    _generate(tcp_group, "for-the-dump")
    run_dir = str(tcp_group.run_dir)
    base = [sys.executable, "-m", "vllm_actors", "stats", "--run-dir", run_dir]
    summary = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert json.loads(summary.stdout)["requests_finished"] >= 1
    # --address with a TCP endpoint: the keys still come from the group's run directory
    address = subprocess.run([*base, "--address", tcp_group.addresses.metrics, "--json"], capture_output=True,
                             text=True, timeout=60)
    assert address.returncode == 0, address.stderr
    dump = tmp_path / "events.jsonl"
    result = subprocess.run([*base, "--dump", str(dump)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["path"] == str(dump)
    assert any(json.loads(line)["type"] == "FINISHED" for line in dump.read_text().splitlines())
    assert not list(tcp_group.run_dir.glob("events-*.jsonl"))  # moved out of the run directory, not copied
