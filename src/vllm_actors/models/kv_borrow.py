"""Borrowed KV capacity across replicas, in the model: the home's attention backend and a lender's
share of a borrowing request (``kernels/kv_borrow.py`` holds the math and the table's layout).

The home runs the whole model. Its backend (``BorrowingAttention``) sends the step's sequences
without a loan to its usual backend; for a *guest* (a sequence with a loan, ``begin_step``) it asks
each lender for its share through a ``LendCall`` (the transport: a direct call in process,
``kv_borrow_link.RemoteLender`` between replicas' workers), attends the home's share itself while
the lenders work, and merges the shares by their LSE. A lender (``LenderShare``) holds its layers'
caches and the blocks it lent per request; ``attend`` is its answer to one layer of the home's
step: it stores the new K/V falling in its blocks and returns its partial output and LSE. It never
runs a linear layer. Each share is a run of the guest's table (``kernels/kv_borrow.ShareRun``),
attended on the GPU kernels of KV parallelism where the caller gives them (``kernels``), else on
the torch loop.

On a GPU:

* The home's step with a guest runs eagerly (the worker marks its batch ``eager``: the guest's
  attention calls out to the lenders, which no CUDA graph can hold); steps without one replay the
  graphs as before. ``prepare`` works out the step once (the other sequences' metadata, each guest's
  rows and its home run), and sets the slots of a guest's tokens in lent blocks to -1, so that the
  model's fused K/V write (``kv_written``) skips them: the home's row holds placeholders (block 0)
  where the lenders' blocks sit, and those tokens' K/V belong to the lenders.
* A lender answers on a thread of its own (``LenderServer``), on a CUDA stream of its own, beside
  its own steps on the main stream. Only that thread writes and reads a loan's blocks, in its
  stream's order. Ordered across the streams: ``lend`` records an event on the main stream (the
  loan's blocks may have been another request's, with work still queued), which the thread's
  stream waits for before touching them; ``give_back`` waits for a call on the loan still being
  answered and makes the main stream wait for the thread's last work on the loan's blocks, before
  the lender's own requests may take them.

Only a guest without an fp8 KV cache, sliding windows or soft caps runs here (refused with a
``ValueError``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import torch

from vllm_actors.kernels.attention import AttentionBackend, AttentionMetadata
from vllm_actors.kernels.kv_borrow import ShareRun, merge_shares, run_attention

if TYPE_CHECKING:
    from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention

log = structlog.get_logger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


class PendingShare(Protocol):
    """A lender asked and not yet answered (``wait``: its output and LSE): the home asks every
    lender of a guest's layer before it waits for any, so they attend at once."""

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        ...


# A lender's answer to one layer of the home's step of a guest: (layer, request id, the table index
# of the lender's first block, q [T, H, D], k and v [T, KV, D] of the step's tokens, seq_len, scale)
# -> its output [T, H, D] and LSE [T, H], or a ``PendingShare`` of them.
LendCall = Callable[[int, str, int, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                    "tuple[torch.Tensor, torch.Tensor] | PendingShare"]
LOAN_WAIT_S = 60.0  # how long a lender waits for a loan's blocks to reach it (its plan) before failing
RETURNED_KEPT = 1024  # loans given back that a late call may still name (answered as an empty share)


def answered(answer: tuple[torch.Tensor, torch.Tensor] | PendingShare) -> tuple[torch.Tensor, torch.Tensor]:
    return answer if isinstance(answer, tuple) else answer.wait()


@dataclass(frozen=True)
class Guest:
    """A borrowing request as its home runs it: its lenders in table order, with their block counts."""

    request_id: str
    lenders: Sequence[tuple[LendCall, int]]

    @property
    def num_lent(self) -> int:
        """The lenders' blocks: the front of its table."""
        return sum(count for _, count in self.lenders)


def _mark(device: torch.device) -> torch.cuda.Event | None:
    """An event at the end of the work queued so far on ``device``'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class LenderShare:
    """A lender's part: the caches of its layers, and per guest the blocks it lent (its own ids, in
    table order). The home names where they start in the guest's table with each call. The loans
    change on the lender's own thread (its plans) and are read on the thread answering the home:
    a call for a loan not known yet waits for it (up to ``wait_s``); one for a loan given back
    (the home's step of an aborted request still running) is answered with an empty share.
    ``kernels``: the GPU kernels for the partials (None: the torch loop)."""

    def __init__(self, kv_caches: list[KVCache], wait_s: float = LOAN_WAIT_S,
                 kernels: GpuPartialAttention | None = None) -> None:
        self.kv_caches = kv_caches
        self.wait_s = wait_s
        self.kernels = kernels
        self.device = kv_caches[0][0].device if kv_caches else torch.device("cpu")
        self.loans: dict[str, list[int]] = {}
        self._changed = threading.Condition()
        self._ready: dict[str, torch.cuda.Event | None] = {}  # the main stream's work before the loan
        self._done: dict[str, torch.cuda.Event] = {}  # the answering thread's last work on the loan
        self._ids: dict[str, torch.Tensor] = {}  # the loan's block ids on the device, made on first use
        self._busy: dict[str, int] = {}  # calls on the loan being answered
        self._returned: OrderedDict[str, None] = OrderedDict()

    def lend(self, request_id: str, block_ids: list[int]) -> None:
        ready = _mark(self.device)
        with self._changed:
            self.loans[request_id] = list(block_ids)
            self._ready[request_id] = ready
            self._ids.pop(request_id, None)
            self._returned.pop(request_id, None)
            self._changed.notify_all()

    def give_back(self, request_id: str) -> None:
        """The loan's blocks back to the lender: after a call on them being answered, and (on a GPU)
        with the main stream ordered after the answering thread's work on them."""
        with self._changed:
            self._changed.wait_for(lambda: not self._busy.get(request_id))
            if self.loans.pop(request_id, None) is not None:
                self._returned[request_id] = None
                while len(self._returned) > RETURNED_KEPT:
                    self._returned.popitem(last=False)
            self._ready.pop(request_id, None)
            self._ids.pop(request_id, None)
            done = self._done.pop(request_id, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def blocks_of(self, request_id: str) -> list[int] | None:
        """The loan's blocks, waiting for them to arrive; None for a loan given back."""
        with self._changed:
            self._wait_for(request_id)
            return self.loans.get(request_id)

    def _wait_for(self, request_id: str) -> None:
        if not self._changed.wait_for(lambda: request_id in self.loans or request_id in self._returned, self.wait_s):
            raise LookupError(f"no blocks lent for request {request_id!r} after {self.wait_s} s")

    def attend(self, layer: int, request_id: str, first: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               seq_len: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        with self._changed:  # the loan found and the call counted at once: no return in between
            self._wait_for(request_id)
            blocks = self.loans.get(request_id)
            if blocks is not None:
                self._busy[request_id] = self._busy.get(request_id, 0) + 1
                ready, ids = self._ready.get(request_id), self._ids.get(request_id)
        if blocks is None:
            log.warning("kv_loan_call_after_return", request_id=request_id, layer=layer)
            wide = torch.promote_types(q.dtype, torch.float32)
            return (torch.zeros(q.shape, dtype=wide, device=q.device),
                    torch.full(q.shape[:2], float("-inf"), dtype=wide, device=q.device))
        try:
            if ready is not None:  # the loan's blocks after the lender's earlier work on them
                torch.cuda.current_stream(self.device).wait_event(ready)
            if ids is None:
                ids = torch.tensor(blocks, dtype=torch.int64).to(self.device)
            k_cache, v_cache = self.kv_caches[layer]
            answer = run_attention(q, k, v, k_cache, v_cache, ShareRun(first, ids), seq_len, scale,
                                   kernels=self.kernels)
            done = _mark(self.device)
            with self._changed:
                self._ids[request_id] = ids
                if done is not None:
                    self._done[request_id] = done
            return answer
        finally:
            with self._changed:
                self._busy[request_id] -= 1
                if not self._busy[request_id]:
                    del self._busy[request_id]
                self._changed.notify_all()


@dataclass(frozen=True)
class GuestRows:
    """A guest's rows of the step (``begin`` .. ``end``), its context after it, its home run."""

    guest: Guest
    begin: int
    end: int
    seq_len: int
    home: ShareRun


@dataclass
class BorrowingMetadata(AttentionMetadata):
    """A step with guests as ``BorrowingAttention.prepare`` leaves it: its slots (-1 for a guest's
    tokens in lent blocks), the other sequences' rows and metadata (prepared by the inner backend),
    and the guests' rows."""

    others: tuple[torch.Tensor, AttentionMetadata] | None = None
    guest_rows: list[GuestRows] = dataclasses.field(default_factory=list)


class BorrowingAttention:
    """The home's backend: ``inner`` for the sequences without a loan, the shares for the guests
    (``block_size``: the caches'; ``kernels``: the GPU kernels for the home's share, None: the
    torch loop)."""

    def __init__(self, inner: AttentionBackend, block_size: int, kernels: GpuPartialAttention | None = None) -> None:
        self.inner, self.block_size, self.kernels = inner, block_size, kernels
        self.guests: dict[int, Guest] = {}  # batch index -> its guest, for the current step
        self._layer = 0

    @property
    def name(self) -> str:
        return f"{getattr(self.inner, 'name', 'torch')}+borrowed"

    def begin_step(self, guests: dict[int, Guest]) -> None:
        """The guests among the next step's sequences, by their index in its batch."""
        self.guests = guests

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        self._layer = 0
        if not self.guests or (meta.slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.inner.prepare(meta)  # a CUDA graph never holds a guest (its step runs eagerly)
        return self._with_guests(meta)

    def _with_guests(self, meta: AttentionMetadata) -> BorrowingMetadata:
        device, block_size = meta.slot_mapping.device, self.block_size
        starts = [0]
        for q_len in meta.query_lens_cpu:
            starts.append(starts[-1] + q_len)
        slot_mapping = meta.slot_mapping.clone()
        guest_rows = []
        for index, guest in sorted(self.guests.items()):
            begin, end, seq_len = starts[index], starts[index + 1], meta.seq_lens_cpu[index]
            if begin == end:
                continue
            lent = guest.num_lent
            width = -(-seq_len // block_size)
            home = ShareRun(lent, meta.block_tables[index, lent:max(width, lent)].long())
            in_lent = min(max(lent * block_size - (seq_len - (end - begin)), 0), end - begin)
            slot_mapping[begin:begin + in_lent] = -1  # the lenders store them: a fused write skips them
            guest_rows.append(GuestRows(guest, begin, end, seq_len, home))
        others = None
        indices = [i for i in range(meta.num_seqs) if i not in self.guests and meta.query_lens_cpu[i]]
        if indices:
            rows = torch.tensor([row for i in indices for row in range(starts[i], starts[i + 1])],
                                dtype=torch.int64).to(device)
            query_lens = [meta.query_lens_cpu[i] for i in indices]
            seq_lens = [meta.seq_lens_cpu[i] for i in indices]
            query_starts = [0]
            for q_len in query_lens:
                query_starts.append(query_starts[-1] + q_len)
            sub = AttentionMetadata(
                slot_mapping=meta.slot_mapping.index_select(0, rows),
                query_start_loc=torch.tensor(query_starts, dtype=torch.int32).to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
                block_tables=meta.block_tables.index_select(0, torch.tensor(indices, dtype=torch.int64).to(device)),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                query_lens_cpu=query_lens,
                seq_lens_cpu=seq_lens,
            )
            others = (rows, self.inner.prepare(sub))
        fields = {field.name: getattr(meta, field.name) for field in dataclasses.fields(AttentionMetadata)}
        fields["slot_mapping"] = slot_mapping
        return BorrowingMetadata(**fields, others=others, guest_rows=guest_rows)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_written: bool = False,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        layer, self._layer = self._layer, self._layer + 1
        if not isinstance(meta, BorrowingMetadata):
            return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, kv_written=kv_written, k_scale=k_scale,
                                      v_scale=v_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if k_scale is not None or sliding_window is not None or logits_soft_cap is not None:
            raise ValueError("a borrowing request runs without an fp8 KV cache, sliding window or soft cap")
        out = torch.empty_like(q)
        if meta.others is not None:
            rows, sub = meta.others
            out[rows] = self.inner.forward(q[rows], k[rows], v[rows], k_cache, v_cache, sub, scale,
                                           kv_written=kv_written)
        for part in meta.guest_rows:
            begin, end, seq_len = part.begin, part.end, part.seq_len
            qs, ks, vs = q[begin:end], k[begin:end], v[begin:end]
            asked: list[Any] = []
            first = 0
            for call, count in part.guest.lenders:  # every lender asked before any answer is awaited
                asked.append(call(layer, part.guest.request_id, first, qs, ks, vs, seq_len, scale))
                first += count
            shares = [run_attention(qs, ks, vs, k_cache, v_cache, part.home, seq_len, scale, store=not kv_written,
                                    kernels=self.kernels)]
            shares += [answered(answer) for answer in asked]
            out[begin:end] = merge_shares(shares).to(q.dtype)
        return out
