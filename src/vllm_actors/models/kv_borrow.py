"""Borrowed KV capacity across replicas, in the model: the home's attention backend and a lender's
share of a borrowing request (``kernels/kv_borrow.py`` holds the math and the table's layout).

The home runs the whole model. Its backend (``BorrowingAttention``) sends the step's sequences
without a loan to its usual backend; for a *guest* (a sequence with a loan, ``begin_step``) it
stores and attends the home's share itself, asks each lender for its share through a ``LendCall``
(the transport: a direct call in process, a side channel between replicas' workers once built),
and merges the shares by their LSE. A lender (``LenderShare``) holds its layers' caches and the
blocks it lent per request; ``attend`` is its answer to one layer of the home's step: it stores the
new K/V falling in its blocks and returns its partial output and LSE. It never runs a linear layer.

Only the torch loop (the CPU's) runs here, without an fp8 KV cache, sliding windows or soft caps
for the guests; the home's table row of a guest holds placeholders where the lenders' blocks sit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_actors.kernels.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from vllm_actors.kernels.kv_borrow import BorrowedTable, merge_shares, share_attention

KVCache = tuple[torch.Tensor, torch.Tensor]
# A lender's answer to one layer of the home's step of a guest: (layer, request id, the table index
# of the lender's first block, q [T, H, D], k and v [T, KV, D] of the step's tokens, seq_len, scale)
# -> its output [T, H, D] and LSE [T, H].
LendCall = Callable[[int, str, int, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                    tuple[torch.Tensor, torch.Tensor]]
LOAN_WAIT_S = 60.0  # how long a lender waits for a loan's blocks to reach it (its plan) before failing


@dataclass(frozen=True)
class Guest:
    """A borrowing request as its home runs it: its lenders in table order, with their block counts."""

    request_id: str
    lenders: Sequence[tuple[LendCall, int]]

    def table(self, home_row: Sequence[int], num_blocks: int) -> BorrowedTable:
        """Its first ``num_blocks`` table blocks over the participants (0: the home, whose row
        ``home_row`` holds its own blocks after the lenders' placeholders)."""
        owners = [index + 1 for index, (_, count) in enumerate(self.lenders) for _ in range(count)]
        owners = (owners + [0] * num_blocks)[:num_blocks]
        blocks = [int(home_row[j]) if owner == 0 else 0 for j, owner in enumerate(owners)]
        return BorrowedTable(owners, blocks, len(self.lenders) + 1)


class LenderShare:
    """A lender's part: the caches of its layers, and per guest the blocks it lent (its own ids, in
    table order). The home names where they start in the guest's table with each call. The loans
    change on the lender's own thread (its plans) and are read on the thread answering the home:
    a call for a loan not known yet waits for it (up to ``wait_s``)."""

    def __init__(self, kv_caches: list[KVCache], wait_s: float = LOAN_WAIT_S) -> None:
        self.kv_caches = kv_caches
        self.wait_s = wait_s
        self.loans: dict[str, list[int]] = {}
        self._changed = threading.Condition()

    def lend(self, request_id: str, block_ids: list[int]) -> None:
        with self._changed:
            self.loans[request_id] = list(block_ids)
            self._changed.notify_all()

    def give_back(self, request_id: str) -> None:
        with self._changed:
            self.loans.pop(request_id, None)

    def blocks_of(self, request_id: str) -> list[int]:
        with self._changed:
            if not self._changed.wait_for(lambda: request_id in self.loans, self.wait_s):
                raise LookupError(f"no blocks lent for request {request_id!r} after {self.wait_s} s")
            return self.loans[request_id]

    def attend(self, layer: int, request_id: str, first: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               seq_len: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = self.blocks_of(request_id)
        k_cache, v_cache = self.kv_caches[layer]
        num_blocks = -(-seq_len // k_cache.shape[1])
        owners = [1 if first <= j < first + len(blocks) else 0 for j in range(num_blocks)]
        ids = [blocks[j - first] if owner else 0 for j, owner in enumerate(owners)]
        return share_attention(q, k, v, k_cache, v_cache, BorrowedTable(owners, ids, 2), 1, seq_len, scale)


class BorrowingAttention:
    """The home's backend: ``inner`` for the sequences without a loan, the shares for the guests."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
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
        return meta if self.guests else self.inner.prepare(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_written: bool = False,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        layer, self._layer = self._layer, self._layer + 1
        if not self.guests:
            return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, kv_written=kv_written, k_scale=k_scale,
                                      v_scale=v_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if kv_written or k_scale is not None or sliding_window is not None or logits_soft_cap is not None:
            raise ValueError("a borrowing request runs on the torch loop only: no fused K/V write, fp8 KV "
                             "cache, sliding window or soft cap")
        out = torch.empty_like(q)
        starts = [0]
        for q_len in meta.query_lens_cpu:
            starts.append(starts[-1] + q_len)
        others = [i for i in range(meta.num_seqs) if i not in self.guests and meta.query_lens_cpu[i]]
        if others:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in others]).to(q.device)
            tables = [meta.block_tables[i].tolist() for i in others]
            sub = build_attention_metadata([meta.query_lens_cpu[i] for i in others],
                                           [meta.seq_lens_cpu[i] for i in others], tables,
                                           k_cache.shape[1], q.device)
            out[rows] = self.inner.forward(q[rows], k[rows], v[rows], k_cache, v_cache, self.inner.prepare(sub),
                                           scale)
        for index, guest in self.guests.items():
            begin, end = starts[index], starts[index + 1]
            if begin == end:
                continue
            seq_len = meta.seq_lens_cpu[index]
            table = guest.table(meta.block_tables[index].tolist(), -(-seq_len // k_cache.shape[1]))
            qs, ks, vs = q[begin:end], k[begin:end], v[begin:end]
            parts = [share_attention(qs, ks, vs, k_cache, v_cache, table, 0, seq_len, scale)]
            first = 0
            for call, count in guest.lenders:
                parts.append(call(layer, guest.request_id, first, qs, ks, vs, seq_len, scale))
                first += count
            out[begin:end] = merge_shares(parts).to(q.dtype)
        return out
