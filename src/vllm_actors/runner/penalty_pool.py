"""What the penalties read, kept on the logits' device between steps: for each request that sets
a presence, frequency or repetition penalty, which tokens its prompt holds and how often each token
occurs in its output.

Rebuilding both from the token lists every step would cost the host O(prompt + output) per row,
and, since the lists lag the device under deferred steps, make every step with such a row wait for
the previous step's tokens. Here a request's rows are filled once, at admission (its prompt, and
the outputs of a resumed request), and each token drawn is counted on the device right after the
draw (``record``), so a penalised row reads nothing from the host and its steps overlap like any other.

One slot per request, in two ``[capacity, vocab]`` tensors (bool and float32: 5 bytes per token of
the vocabulary), grown by doubling; the vocabulary is that of the first logits seen. Slots are
reused once their request is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_actors.actors.worker.uploads import upload
from vllm_actors.kernels import penalties as kernel
from vllm_actors.kernels.choice import use_triton


def penalty_kernel_enabled(device: torch.device) -> bool:
    """The Triton penalties kernel (``VLLM_ACTORS_PENALTIES``: ``torch`` or ``triton``)."""
    return use_triton("VLLM_ACTORS_PENALTIES", kernel.HAVE_TRITON, device)


class PenaltyPool:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._next = 0
        self._pending: dict[int, tuple[list[int], list[int]]] = {}  # slot -> (prompt, outputs) to write
        self._vocab = 0
        self.prompt_seen = torch.zeros((0, 0), dtype=torch.bool, device=device)
        self.output_counts = torch.zeros((0, 0), dtype=torch.float32, device=device)

    def __len__(self) -> int:
        return len(self._slots)

    def add(self, request_id: str, prompt: Sequence[int], outputs: Sequence[int]) -> int:
        """A slot for the request (replacing any it had), written from its tokens at first use."""
        self.remove(request_id)
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._next = self._next, self._next + 1
        self._slots[request_id] = slot
        self._pending[slot] = (list(prompt), list(outputs))
        return slot

    def remove(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._pending.pop(slot, None)
            self._free.append(slot)

    def clear(self) -> None:
        self._slots.clear()
        self._pending.clear()
        self._free.clear()
        self._next = 0

    def penalise(self, logits: torch.Tensor, rows: Sequence[int], slots: Sequence[int], scalars: torch.Tensor) -> None:
        """vLLM's repetition, frequency and presence penalties on ``logits`` (float32 [N, V], in
        place): row ``rows[i]`` reads slot ``slots[i]``; ``scalars`` [3, n] float32 on the device.
        One Triton pass over those rows where the kernel runs (a GPU, or ``VLLM_ACTORS_PENALTIES=
        triton``), else the same in torch."""
        self._prepare(logits.shape[1])
        row_index = upload(rows, self.device)
        slot_index = upload(slots, self.device)
        apply = kernel.apply_penalties if penalty_kernel_enabled(self.device) else kernel.apply_penalties_torch
        apply(logits, row_index, slot_index, self.prompt_seen, self.output_counts, scalars)

    def read(self, slots: Sequence[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' prompt tokens seen and output counts ([n, vocab] bool and float32 copies)."""
        self._prepare(vocab)
        index = upload(slots, self.device)
        return self.prompt_seen.index_select(0, index), self.output_counts.index_select(0, index)

    def record(self, slots: Sequence[int], chosen: torch.Tensor) -> None:
        """Count each slot's drawn token (``chosen``: one id per slot, on the device)."""
        if not slots:
            return
        index = upload(slots, self.device)
        ones = torch.ones(len(slots), dtype=torch.float32, device=self.device)
        self.output_counts.index_put_((index, chosen.to(torch.long)), ones, accumulate=True)

    def count_kept(self, slots: Sequence[int], token_ids: Sequence[int]) -> None:
        """``record`` of ids on the host (a verification's kept tokens)."""
        if slots:
            self.record(slots, upload(token_ids, self.device))

    def _prepare(self, vocab: int) -> None:
        if self._vocab == 0:
            self._vocab = vocab
        elif vocab != self._vocab:
            raise ValueError(f"logits of {vocab} tokens, the penalty pool holds {self._vocab}")
        if self._next > self.prompt_seen.shape[0]:
            self._grow(self._next)
        if self._pending:
            self._write_pending()

    def _grow(self, needed: int) -> None:
        capacity = max(16, self.prompt_seen.shape[0])
        while capacity < needed:
            capacity *= 2
        seen = torch.zeros((capacity, self._vocab), dtype=torch.bool, device=self.device)
        counts = torch.zeros((capacity, self._vocab), dtype=torch.float32, device=self.device)
        old = self.prompt_seen.shape[0]
        if old:
            seen[:old] = self.prompt_seen
            counts[:old] = self.output_counts
        self.prompt_seen, self.output_counts = seen, counts

    def _write_pending(self) -> None:
        """The new slots' rows from their tokens, in one scatter each (ids outside the vocabulary are
        left out, as the draw can never produce them)."""
        vocab = self._vocab
        slots = list(self._pending)
        index = upload(slots, self.device)
        self.prompt_seen.index_fill_(0, index, False)
        self.output_counts.index_fill_(0, index, 0.0)
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        output_rows: list[int] = []
        output_ids: list[int] = []
        for slot, (prompt, outputs) in self._pending.items():
            kept = [token for token in prompt if 0 <= token < vocab]
            prompt_rows += [slot] * len(kept)
            prompt_ids += kept
            kept = [token for token in outputs if 0 <= token < vocab]
            output_rows += [slot] * len(kept)
            output_ids += kept
        self._pending.clear()
        if prompt_ids:
            where = (upload(prompt_rows, self.device), upload(prompt_ids, self.device))
            self.prompt_seen.index_put_(where, torch.ones(len(prompt_ids), dtype=torch.bool, device=self.device))
        if output_ids:
            where = (upload(output_rows, self.device), upload(output_ids, self.device))
            ones = torch.ones(len(output_ids), dtype=torch.float32, device=self.device)
            self.output_counts.index_put_(where, ones, accumulate=True)

