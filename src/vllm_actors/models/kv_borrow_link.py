"""Borrowed KV between processes: the home's ``LendCall`` to a lender over ``torch.distributed``
point-to-point on a gloo group, and the lender's thread answering it beside its own steps.

Per layer of a guest's step the home sends a header (``ATTEND``, layer, seq_len, tokens, the
request id's length, the scale, the table index of the lender's first block, where the tensor is;
float64), the request id's bytes, then q, k and v packed as one [T, H + 2 KV, D] tensor in the
model's dtype; the lender answers a doorbell (1, where the reply is) and ``[T, H, D + 1]`` (its
output and LSE) in float32 (float64 for float64 queries). Tensors travel as their bytes (gloo's
point-to-point copies bytes whatever the dtype; bfloat16 included), or, between the replicas of one
host (``SharedRegions``, ``kv_borrow_shm``), lie in shared memory, the header naming the region: the
home's request region for q, k and v, the lender's reply region for that home for its answer.
``STOP`` ends the lender's thread. A call the lender fails to answer (no such loan after its wait,
the device out of memory) gets a reply whose LSE is NaN, which the home raises on (a real LSE is
finite or ``-inf``), and the lender's thread goes on serving: a home never waits for a reply that
will not come. The messages' sizes follow the step's tokens, never the context.
Requests and replies travel under tags of their own, so a process may be a home and a lender at once
(its main thread asking a peer while its lender thread waits for that peer's requests). The home
asks every lender of a guest's layer (``RemoteLender`` returns a ``PendingReply``) before it waits
for any reply, and attends its own share in between: the lenders and the home attend at once.

On GPUs the same gloo group carries the tensors, staged through pinned host memory: the home packs
q, k and v on the device and copies them to pinned memory once for all its lenders (``QkvStaging``:
one non-blocking copy, then a wait for the current stream), and copies each reply back with a
non-blocking copy from the pinned buffer it was received in; a lender receives into pinned memory,
copies to its device, attends on the GPU kernels and copies its reply to pinned memory before it
sends it. Gloo rather than NCCL: NCCL's point-to-point would spare the host copies (NVLink), but a
communicator must not be used by two threads at once, and here the main thread (the home's calls)
and every lender thread (answers) exchange at once; NCCL would need a communicator per (home,
lender) pair, each used by one thread on either side (N (N - 1) of them, each with its buffers), and
a header read on the host before each receive to size it. Gloo needs one group, and works between
the processes of one host and across hosts alike; NCCL pairs are the faster path, next.

A lender's thread (``LenderServer``) sets its device and runs on a CUDA stream of its own, so its
work neither waits for the lender's own steps on the main stream nor holds them up; ``LenderShare``
orders the loan's blocks between the two streams.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from vllm_actors.models.kv_borrow import LenderShare
from vllm_actors.models.kv_borrow_shm import ShmRegion, nbytes_of, reply_name, request_name

log = structlog.get_logger(__name__)

# The exchanges' group timeout: a lender's thread waits for its home's next layer as long as the set
# lives (gloo applies its group's timeout to every receive; a peer that dies closes its socket, an
# error at once). The set's rendezvous keeps its own, shorter one.
EXCHANGE_TIMEOUT = timedelta(days=30)
ATTEND, STOP = 1.0, 0.0
HEADER = 8
REPLY_HEADER = 2  # (1, where the reply is): the lender's answer's doorbell
GLOO, SHM = 0.0, 1.0  # where a request's or a reply's tensor travels: its bytes over gloo, or a shared region
ASK, ANSWER = 1, 2  # the tags of the home's requests and of the lender's replies


def exchange_group(size: int) -> Any:
    """The gloo group of the exchanges among ``size`` ranks (every rank calls it, in the same order
    of groups), under ``EXCHANGE_TIMEOUT``."""
    return dist.new_group(list(range(size)), backend="gloo", timeout=EXCHANGE_TIMEOUT)


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to receive into: pinned when its contents go to (or came from) a GPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_host(x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` contiguous on the host, complete: itself on the CPU; from a GPU, a pinned copy made by one
    non-blocking copy and a wait for the current stream (which computed ``x``). ``into``: a host tensor of
    its shape to copy it to instead (a shared region's view), returned."""
    if into is not None:
        into.copy_(x, non_blocking=x.device.type == "cuda")
        if x.device.type == "cuda":
            torch.cuda.current_stream(x.device).synchronize()
        return into
    if x.device.type != "cuda":
        return x.contiguous()
    host = host_buffer(tuple(x.shape), x.dtype, x.device)
    host.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return host


class SharedRegions:
    """A process's shared regions of one replica set (``kv_borrow_shm``): the one it writes for each
    peer (created at the first call that fits, for ``capacity`` tokens) and those it reads (mapped when a
    header first names them). ``prefix``: the set's (``region_prefix``); ``capacity``: the step's tokens."""

    def __init__(self, prefix: str, capacity: int, device: torch.device) -> None:
        self.prefix, self.capacity, self.device = prefix, capacity, device
        self._regions: dict[str, ShmRegion | None] = {}  # None: could not be made (no room): gloo for it

    def written(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The view to write ``shape`` into in region ``name`` (created on first use for ``capacity``
        tokens of ``shape[1:]``); None when it does not fit or could not be made (the call goes over gloo)."""
        if name not in self._regions:
            nbytes = nbytes_of((self.capacity, *shape[1:]), dtype)
            try:
                self._regions[name] = ShmRegion(name, self.device, nbytes=nbytes, create=True)
            except OSError as error:  # a /dev/shm without room for it (kv_borrow_shm.ROOM)
                log.warning("kv_borrow_shm_unavailable", region=name, bytes=nbytes, error=repr(error))
                self._regions[name] = None
        region = self._regions[name]
        return region.view(shape, dtype) if region is not None and region.fits(shape, dtype) else None

    def read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        region = self._regions.get(name)
        if region is None:
            region = self._regions[name] = ShmRegion(name, self.device)
        return region.view(shape, dtype)

    def close(self) -> None:
        for region in self._regions.values():
            if region is not None:
                region.close()
        self._regions.clear()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: a non-blocking copy on the current stream from pinned memory
    (the host allocator keeps the buffer until the copy has run); itself on the CPU."""
    return host.to(device, non_blocking=device.type == "cuda")


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as uint8 (a view: what is received in it lands in ``x``)."""
    return x.view(-1).view(torch.uint8)


class QkvStaging:
    """q, k and v of a guest's layer packed as [T, H + 2 KV, D] on the host, once for all the lenders
    asked with the same tensors (the last call's result is kept, with its tensors); with ``regions``, in
    the home's request region (``home``: its rank) where it fits, else in a host tensor of its own."""

    def __init__(self, regions: SharedRegions | None = None, home: int = 0) -> None:
        self.regions, self.home = regions, home
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None

    def packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The packed tensor on the host and where it lies (``SHM``: the request region; ``GLOO``: to send)."""
        last = self._last
        if last is not None and last[0] is q and last[1] is k and last[2] is v:
            return last[3], last[4]
        shape = (q.shape[0], q.shape[1] + k.shape[1] + v.shape[1], q.shape[2])
        into = None if self.regions is None else \
            self.regions.written(request_name(self.regions.prefix, self.home), shape, q.dtype)
        host = to_host(torch.cat((q, k, v), dim=1), into)
        where = GLOO if into is None else SHM
        self._last = (q, k, v, host, where)
        return host, where


def unpack(payload: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k and v (contiguous) of a packed [T, H + 2 KV, D] tensor."""
    q, k, v = payload.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    return q.contiguous(), k.contiguous(), v.contiguous()


class PendingReply:
    """A lender asked: ``wait`` receives its reply and returns its output and LSE on the home's device
    (``regions``: where a reply in the lender's region for this home is read; ``home``: this rank)."""

    def __init__(self, peer: int, group: Any, shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device, regions: SharedRegions | None = None, home: int = 0) -> None:
        self.peer, self.group, self.shape, self.dtype, self.device = peer, group, shape, dtype, device
        self.regions, self.home = regions, home

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, head_dim = self.shape
        shape = (num_tokens, num_heads, head_dim + 1)
        doorbell = torch.empty(REPLY_HEADER, dtype=torch.float64)
        dist.recv(doorbell, self.peer, group=self.group, tag=ANSWER)
        if doorbell[1].item() == SHM and self.regions is not None:
            reply = self.regions.read(reply_name(self.regions.prefix, self.home, self.peer), shape, self.dtype)
            if self.device.type != "cuda":
                reply = reply.clone()  # the region is the lender's to write again at the next call
        else:
            reply = host_buffer(shape, self.dtype, self.device)
            dist.recv(as_bytes(reply), self.peer, group=self.group, tag=ANSWER)
        if torch.isnan(reply[..., head_dim]).any():  # on the host already: no device wait
            raise RuntimeError(f"the lender at rank {self.peer} could not answer (its log says why)")
        reply = to_device(reply, self.device)
        return reply[..., :head_dim], reply[..., head_dim]


class RemoteLender:
    """The home's ``LendCall`` to the lender at rank ``peer`` of ``group`` (None: the world):
    sends the layer's request at once and returns a ``PendingReply``. ``staging``: shared by the
    home's lenders, so q, k and v reach the host once a layer."""

    def __init__(self, peer: int, group: Any = None, staging: QkvStaging | None = None) -> None:
        self.peer, self.group = peer, group
        self.staging = staging or QkvStaging()

    def __call__(self, layer: int, request_id: str, first: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, seq_len: int, scale: float) -> PendingReply:
        name = request_id.encode()
        payload, where = self.staging.packed(q, k, v)
        header = torch.tensor([ATTEND, layer, seq_len, q.shape[0], len(name), scale, first, where],
                              dtype=torch.float64)
        tensors = [header, torch.tensor(list(name), dtype=torch.uint8)]
        if where == GLOO:
            tensors.append(as_bytes(payload))
        for tensor in tensors:
            dist.send(tensor, self.peer, group=self.group, tag=ASK)
        num_tokens, num_heads, head_dim = q.shape
        return PendingReply(self.peer, self.group, (num_tokens, num_heads, head_dim),
                            torch.promote_types(q.dtype, torch.float32), q.device, self.staging.regions,
                            self.staging.home)

    def stop(self) -> None:
        """Ends the lender's thread serving this home."""
        header = torch.zeros(HEADER, dtype=torch.float64)
        header[0] = STOP
        dist.send(header, self.peer, group=self.group, tag=ASK)


@contextlib.contextmanager
def lender_context(device: torch.device) -> Iterator[torch.cuda.Stream | None]:
    """A lender thread's device and CUDA stream of its own (nothing off CUDA), under inference mode."""
    with torch.inference_mode():
        if device.type != "cuda":
            yield None
            return
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            yield stream


class LenderServer:
    """A lender's thread answering one home (rank ``home``): ``share`` attends, on the lender's caches
    (on ``share.device``, from a stream of the thread's own on a GPU)."""

    def __init__(self, share: LenderShare, home: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, group: Any = None, regions: SharedRegions | None = None, rank: int = 0) -> None:
        """``regions``: where this lender (``rank``) writes its replies to ``home`` and reads its requests."""
        self.share, self.home, self.group = share, home, group
        self.regions, self.rank = regions, rank
        self.shapes = (num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.num_calls = 0
        self.error: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=f"lender-for-{self.home}", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            with lender_context(self.share.device):
                while self.serve_one():
                    pass
        except BaseException as error:  # the home learns nothing more; its owner reads this
            self.error = error

    def serve_one(self) -> bool:
        """Answer one layer of the home's step; False on ``STOP``."""
        header = torch.empty(HEADER, dtype=torch.float64)
        dist.recv(header, self.home, group=self.group, tag=ASK)
        op, layer, seq_len, num_tokens, name_len, scale, first, where = header.tolist()
        if op == STOP:
            return False
        name = torch.empty(int(name_len), dtype=torch.uint8)
        dist.recv(name, self.home, group=self.group, tag=ASK)
        num_heads, num_kv_heads, head_dim = self.shapes
        device = self.share.device
        shape = (int(num_tokens), num_heads + 2 * num_kv_heads, head_dim)
        regions = self.regions
        shared = regions if where == SHM else None  # the home's request region holds it
        if shared is None:
            payload = host_buffer(shape, self.dtype, device)
            dist.recv(as_bytes(payload), self.home, group=self.group, tag=ASK)
        request_id = bytes(name.tolist()).decode()
        wide = torch.promote_types(self.dtype, torch.float32)
        reply_shape = (int(num_tokens), num_heads, head_dim + 1)
        into = None if regions is None else \
            regions.written(reply_name(regions.prefix, self.home, self.rank), reply_shape, wide)
        try:  # the request's copies are done before the reply goes (to_host waits for this thread's stream)
            if shared is not None:  # mapped here: a region the lender cannot map is an answer the home refuses
                payload = shared.read(request_name(shared.prefix, self.home), shape, self.dtype)
            q, k, v = unpack(to_device(payload, device), num_heads, num_kv_heads)
            out, lse = self.share.attend(int(layer), request_id, int(first), q, k, v, int(seq_len), scale)
            reply = to_host(torch.cat((out, lse.unsqueeze(-1)), dim=-1).to(wide), into)
        except Exception as error:  # the home gets a reply it refuses (LSE NaN) rather than none
            log.error("kv_lender_call_failed", home=self.home, request_id=request_id, layer=int(layer),
                      error=repr(error))
            self.error = error
            reply = torch.full(reply_shape, float("nan"), dtype=wide)
            if into is not None:
                reply = into.copy_(reply)
        doorbell = torch.tensor([1.0, GLOO if into is None else SHM], dtype=torch.float64)
        dist.send(doorbell, self.home, group=self.group, tag=ANSWER)
        if into is None:
            dist.send(as_bytes(reply), self.home, group=self.group, tag=ANSWER)
        self.num_calls += 1
        return True
