"""Borrowed KV between processes: the home's ``LendCall`` to a lender over ``torch.distributed``
point-to-point (gloo on the CPU), and the lender's thread answering it beside its own steps.

Per layer of a guest's step the home sends a header (``ATTEND``, layer, seq_len, tokens, the
request id's length, the scale, the table index of the lender's first block; float64), the request
id's bytes, then q [T, H, D], k and v [T, KV, D] in the model's dtype; the lender answers
``[T, H, D + 1]`` (its output and LSE) in float32 (float64 for float64 queries). ``STOP`` ends the
lender's thread. The messages' sizes follow the step's tokens, never the context. Requests and
replies travel under tags of their own, so a process may be a home and a lender at once (its main
thread asking a peer while its lender thread waits for that peer's requests). Each lender is asked
in turn (not yet concurrently).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from vllm_actors.models.kv_borrow import LenderShare

ATTEND, STOP = 1.0, 0.0
HEADER = 7
ASK, ANSWER = 1, 2  # the tags of the home's requests and of the lender's replies


class RemoteLender:
    """The home's ``LendCall`` to the lender at rank ``peer`` of ``group`` (None: the world)."""

    def __init__(self, peer: int, group: Any = None) -> None:
        self.peer, self.group = peer, group

    def __call__(self, layer: int, request_id: str, first: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, seq_len: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        name = request_id.encode()
        header = torch.tensor([ATTEND, layer, seq_len, q.shape[0], len(name), scale, first], dtype=torch.float64)
        for tensor in (header, torch.tensor(list(name), dtype=torch.uint8), q, k, v):
            dist.send(tensor.contiguous(), self.peer, group=self.group, tag=ASK)
        num_tokens, num_heads, head_dim = q.shape
        reply = torch.empty((num_tokens, num_heads, head_dim + 1), dtype=torch.promote_types(q.dtype, torch.float32))
        dist.recv(reply, self.peer, group=self.group, tag=ANSWER)
        return reply[..., :head_dim], reply[..., head_dim]

    def stop(self) -> None:
        """Ends the lender's thread serving this home."""
        header = torch.zeros(HEADER, dtype=torch.float64)
        header[0] = STOP
        dist.send(header, self.peer, group=self.group, tag=ASK)


class LenderServer:
    """A lender's thread answering one home (rank ``home``): ``share`` attends, on the lender's caches."""

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
        q = torch.empty((int(num_tokens), num_heads, head_dim), dtype=self.dtype)
        k = torch.empty((int(num_tokens), num_kv_heads, head_dim), dtype=self.dtype)
        v = torch.empty_like(k)
        for tensor in (q, k, v):
            dist.recv(tensor, self.home, group=self.group, tag=ASK)
        out, lse = self.share.attend(int(layer), bytes(name.tolist()).decode(), int(first), q, k, v, int(seq_len),
                                     scale)
        dist.send(torch.cat((out, lse.unsqueeze(-1)), dim=-1).contiguous(), self.home, group=self.group, tag=ANSWER)
        self.num_calls += 1
        return True
