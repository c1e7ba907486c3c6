"""Who may talk to a group's sockets: CURVE on TCP endpoints, private socket files on IPC.

A group on TCP endpoints (``ProcessGroup(config, tcp_host=...)``) has two CURVE key pairs, made
when it is created (``GroupKeys.generate``) and kept in ``<run_dir>/curve.keys`` (mode 0600, in the
0700 run directory): the *server* pair, whose secret key every bound socket holds, and the *client*
pair, which every connecting socket presents (actors to each other and to the bus, the
supervisor, clients, taps). A bound socket asks its process's ZAP handler (``authenticating``)
about each connecting peer's key and accepts the group's client key only; with no handler running
it refuses everyone (``ZAP_ENFORCE_DOMAIN``). A peer without the key file cannot finish the
handshake on any TCP socket: nothing it sends is delivered, nothing is sent to it. The keys never
appear on a command line: actors read the file from the run directory their spec names, clients
from the run directory of the group they attach to.

IPC endpoints carry no keys: their socket files live in the run directory, which ``bind`` checks
is private (owned by this user, no access for group or others), and each file is made 0600 once
bound. ``bind`` and ``connect`` are the one way the project binds and connects a socket.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth.thread

from vllm_actors.runtime.run_dir import GroupAddresses, read_group_info

KEYS_FILE = "curve.keys"
ZAP_DOMAIN = "vllm-actors"

# The contexts (``Context.underlying``) of this process that run a ZAP handler.
_authenticated: set[int] = set()


class GroupKeys(msgspec.Struct, frozen=True, kw_only=True):
    """A group's two CURVE key pairs, Z85-encoded."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    def __repr__(self) -> str:  # never print a secret key
        return f"GroupKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"

    __str__ = __repr__

    @classmethod
    def generate(cls) -> GroupKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support: TCP endpoints cannot be authenticated")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public=server_public.decode(), server_secret=server_secret.decode(),
                   client_public=client_public.decode(), client_secret=client_secret.decode())

    def save(self, run_dir: str | Path) -> Path:
        """Write the key file (mode 0600 from its creation; never over an existing one)."""
        path = Path(run_dir, KEYS_FILE)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(msgspec.json.encode(self))
        return path

    @classmethod
    def load(cls, run_dir: str | Path) -> GroupKeys:
        """Read the key file; refuse one another user owns or that others may read."""
        path = Path(run_dir, KEYS_FILE)
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(descriptor, "rb") as handle:
            info = os.fstat(handle.fileno())
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise PermissionError(f"{path} must belong to this user with mode 0600")
            return msgspec.json.decode(handle.read(), type=cls)


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def uses_tcp(addresses: GroupAddresses) -> bool:
    endpoints = [addresses.bus_in, addresses.bus_out, addresses.metrics, addresses.scheduler,
                 addresses.kv_cache_manager, *addresses.workers, *addresses.bus_in_actors.values(),
                 *(address for replica in addresses.replicas
                   for address in (replica.scheduler, replica.kv_cache_manager, *replica.workers))]
    return any(is_tcp(address) for address in endpoints)


def keys_for(addresses: GroupAddresses, run_dir: str | Path) -> GroupKeys | None:
    """The group's keys when any of its endpoints is TCP (read from its run directory), else None."""
    return GroupKeys.load(run_dir) if uses_tcp(addresses) else None


def attached_scheduler(attach_dir: str | Path) -> tuple[str, GroupKeys]:
    """The entry point of a group attached from its directory (a Ray-placed replica's
    ``attach_dir``: its ``group.json`` and ``curve.keys``): the scheduler's address and the keys."""
    return read_group_info(attach_dir).addresses.scheduler, GroupKeys.load(attach_dir)


def _need_keys(address: str, keys: GroupKeys | None) -> GroupKeys:
    if keys is None:
        raise PermissionError(f"{address} is a TCP endpoint: it needs the group's CURVE keys ({KEYS_FILE})")
    return keys


def _ipc_path(address: str) -> Path | None:
    return Path(address[len("ipc://"):]) if address.startswith("ipc://") else None


def check_private_directory(directory: Path) -> None:
    """Refuse a directory for socket files unless it is this user's and closed to everyone else."""
    info = directory.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(
            f"IPC sockets go in a private directory: {directory} has mode {stat.S_IMODE(info.st_mode):o}"
            f" and owner {info.st_uid}"
        )


def bind(socket: zmq.Socket[Any], address: str, keys: GroupKeys | None) -> None:
    """Bind a server socket: CURVE server with the group's secret key on TCP (a ZAP handler must run
    in its context: ``authenticating``); on IPC, in a private directory, the socket file 0600."""
    if is_tcp(address):
        keys = _need_keys(address, keys)
        if socket.context.underlying not in _authenticated:
            raise RuntimeError(f"binding {address} needs a ZAP handler in this context (security.authenticating)")
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret.encode())
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler answering: nobody gets in
        socket.bind(address)
        return
    path = _ipc_path(address)
    if path is not None:
        check_private_directory(path.parent)
    socket.bind(address)
    if path is not None:
        os.chmod(path, 0o600)


def connect(socket: zmq.Socket[Any], address: str, keys: GroupKeys | None) -> None:
    """Connect a client socket: on TCP as a CURVE client with the group's client key pair."""
    if is_tcp(address):
        keys = _need_keys(address, keys)
        socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
        socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public.encode())
        socket.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret.encode())
    socket.connect(address)


class _GroupClients:
    """The ZAP handler's one question: is this the group's client key?"""

    def __init__(self, client_public: str) -> None:
        self.client_public = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and hmac.compare_digest(key, self.client_public)


@contextlib.contextmanager
def authenticating(context: zmq.Context[Any], keys: GroupKeys | None) -> Iterator[None]:
    """Run a ZAP handler in ``context`` (a thread) that lets in the group's client key only; stops
    it on exit, before the context can be terminated. Nothing to do without keys (IPC)."""
    if keys is None:
        yield
        return
    authenticator = zmq.auth.thread.ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(ZAP_DOMAIN, _GroupClients(keys.client_public))
    _authenticated.add(context.underlying)
    try:
        yield
    finally:
        _authenticated.discard(context.underlying)
        authenticator.stop()
