"""Borrowed KV between processes: the home's ``LendCall`` to a lender over ``torch.distributed``
point-to-point on a gloo group, and the lender's thread answering it beside its own steps.

Per layer of a guest's step the home sends a header (``ATTEND``, layer, seq_len, tokens, the
request id's length, the scale, the table index of the lender's first block; float64), the request
id's bytes, then q, k and v packed as one [T, H + 2 KV, D] tensor in the model's dtype; the lender
answers ``[T, H, D + 1]`` (its output and LSE) in float32 (float64 for float64 queries). Tensors
travel as their bytes (gloo's point-to-point copies bytes whatever the dtype; bfloat16 included).
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

log = structlog.get_logger(__name__)

# The exchanges' group timeout: a lender's thread waits for its home's next layer as long as the set
# lives (gloo applies its group's timeout to every receive; a peer that dies closes its socket, an
# error at once). The set's rendezvous keeps its own, shorter one.
EXCHANGE_TIMEOUT = timedelta(days=30)
ATTEND, STOP = 1.0, 0.0
HEADER = 7
ASK, ANSWER = 1, 2  # the tags of the home's requests and of the lender's replies


def exchange_group(size: int) -> Any:
    """The gloo group of the exchanges among ``size`` ranks (every rank calls it, in the same order
    of groups), under ``EXCHANGE_TIMEOUT``."""
    return dist.new_group(list(range(size)), backend="gloo", timeout=EXCHANGE_TIMEOUT)


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor to receive into: pinned when its contents go to (or came from) a GPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous on the host, complete: itself on the CPU; from a GPU, a pinned copy made by one
    non-blocking copy and a wait for the current stream (which computed ``x``)."""
    if x.device.type != "cuda":
        return x.contiguous()
    host = host_buffer(tuple(x.shape), x.dtype, x.device)
    host.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return host


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: a non-blocking copy on the current stream from pinned memory
    (the host allocator keeps the buffer until the copy has run); itself on the CPU."""
    return host.to(device, non_blocking=device.type == "cuda")


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as uint8 (a view: what is received in it lands in ``x``)."""
    return x.view(-1).view(torch.uint8)


class QkvStaging:
    """q, k and v of a guest's layer packed as [T, H + 2 KV, D] on the host, once for all the lenders
    asked with the same tensors (the last call's result is kept, with its tensors)."""

    def __init__(self) -> None:
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        last = self._last
        if last is not None and last[0] is q and last[1] is k and last[2] is v:
            return last[3]
        host = to_host(torch.cat((q, k, v), dim=1))
        self._last = (q, k, v, host)
        return host


def unpack(payload: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k and v (contiguous) of a packed [T, H + 2 KV, D] tensor."""
    q, k, v = payload.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    return q.contiguous(), k.contiguous(), v.contiguous()


class PendingReply:
    """A lender asked: ``wait`` receives its reply and returns its output and LSE on the home's device."""

    def __init__(self, peer: int, group: Any, shape: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.peer, self.group, self.shape, self.dtype, self.device = peer, group, shape, dtype, device

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, head_dim = self.shape
        reply = host_buffer((num_tokens, num_heads, head_dim + 1), self.dtype, self.device)
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
        header = torch.tensor([ATTEND, layer, seq_len, q.shape[0], len(name), scale, first], dtype=torch.float64)
        payload = self.staging.packed(q, k, v)
        for tensor in (header, torch.tensor(list(name), dtype=torch.uint8), as_bytes(payload)):
            dist.send(tensor, self.peer, group=self.group, tag=ASK)
        num_tokens, num_heads, head_dim = q.shape
        return PendingReply(self.peer, self.group, (num_tokens, num_heads, head_dim),
                            torch.promote_types(q.dtype, torch.float32), q.device)

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
                 dtype: torch.dtype, group: Any = None) -> None:
        self.share, self.home, self.group = share, home, group
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
        op, layer, seq_len, num_tokens, name_len, scale, first = header.tolist()
        if op == STOP:
            return False
        name = torch.empty(int(name_len), dtype=torch.uint8)
        dist.recv(name, self.home, group=self.group, tag=ASK)
        num_heads, num_kv_heads, head_dim = self.shapes
        device = self.share.device
        payload = host_buffer((int(num_tokens), num_heads + 2 * num_kv_heads, head_dim), self.dtype, device)
        dist.recv(as_bytes(payload), self.home, group=self.group, tag=ASK)
        request_id = bytes(name.tolist()).decode()
        wide = torch.promote_types(self.dtype, torch.float32)
        try:
            q, k, v = unpack(to_device(payload, device), num_heads, num_kv_heads)
            out, lse = self.share.attend(int(layer), request_id, int(first), q, k, v, int(seq_len), scale)
            reply = to_host(torch.cat((out, lse.unsqueeze(-1)), dim=-1).to(wide))
        except Exception as error:  # the home gets a reply it refuses (LSE NaN) rather than none
            log.error("kv_lender_call_failed", home=self.home, request_id=request_id, layer=int(layer),
                      error=repr(error))
            self.error = error
            reply = torch.full((int(num_tokens), num_heads, head_dim + 1), float("nan"), dtype=wide)
        dist.send(as_bytes(reply), self.home, group=self.group, tag=ANSWER)
        self.num_calls += 1
        return True
