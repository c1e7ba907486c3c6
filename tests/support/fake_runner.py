"""A deterministic stand-in for the model runner, for scheduling tests without a model.

It keeps a "KV cache" of token ids: each new token is written to the slot its block table gives,
and the next token is a hash of the whole context read back through the block table. So any
scheduling or block-table mistake (a wrong slot, a block shared by two requests, a chunk computed
twice or skipped) changes the generated tokens.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from vllm_actors.actors.worker.ranks import Ranks, SingleRank
from vllm_actors.actors.worker.step_data import BatchInput, GraphSampling
from vllm_actors.protocol.block_runs import iter_runs
from vllm_actors.runner.build import LoadedRunner


@dataclass
class FakeRunner:
    """Implements the worker's ``Runner`` interface (and ``build_worker``'s ``LoadedRunner``)."""

    supports_deferred_inputs = False  # a class attribute: DeferringFakeRunner turns it on

    num_blocks: int
    block_size: int
    vocab_size: int = 97
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=lambda: [0])
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    batches: list[BatchInput] = field(default_factory=list)
    tp: Ranks = field(default_factory=SingleRank)
    max_blocks_per_seq: int | None = None  # None: the worker keeps no table array (execute reads the lists)
    num_host_blocks: int = 0  # a host KV tier of this many blocks (0: none)

    def __post_init__(self) -> None:
        self.slots = [-1] * (self.num_blocks * self.block_size)
        self.host_tier = FakeHostTier(self, self.num_host_blocks) if self.num_host_blocks else None
        self.model_config = SimpleNamespace(
            vocab_size=self.vocab_size,
            derived_max_model_len=self.max_position_embeddings,
            eos_token_ids=self.eos_token_ids,
        )

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def next_token(self, context: list[int]) -> int:
        return zlib.crc32(bytes(str(context), "ascii")) % self.vocab_size

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.batches.append(batch)
        owner: list[tuple[int, int]] = []  # flat index -> (sequence, position)
        flat = 0
        for sequence, query_len in enumerate(batch.query_lens):
            table = batch.block_tables[sequence]
            for _ in range(query_len):
                position = batch.positions[flat]
                self.slots[self._slot(table, position)] = batch.token_ids[flat]
                owner.append((sequence, position))
                flat += 1
        logits = torch.zeros((len(batch.logits_indices), self.vocab_size))
        for row, index in enumerate(batch.logits_indices):
            sequence, position = owner[index]
            table = batch.block_tables[sequence]
            context = [self.slots[self._slot(table, p)] for p in range(position + 1)]
            logits[row] = self.next_logits(context)
        return logits

    def next_logits(self, context: list[int]) -> torch.Tensor:
        """The logits after ``context``: 10 for ``next_token``'s, 0 elsewhere (a subclass may
        give a real distribution)."""
        logits = torch.zeros(self.vocab_size)
        logits[self.next_token(context)] = 10.0
        return logits

    def samples_in_graph(self, batch: BatchInput) -> bool:
        return False  # no decode graph draws here: the worker's sampler does

    def execute_sampled(self, batch: BatchInput, sampling: GraphSampling) -> torch.Tensor:
        raise NotImplementedError("the fake runner samples in no graph (samples_in_graph is False)")

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """What greedy decoding of ``prompt`` alone must produce."""
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(self.next_token(tokens))
        return tokens[len(prompt):]


class FakeHostTier:
    """The host tier of the fake "KV cache": blocks of token ids copied out and back; a slot
    never written reads -1, so a restore from the wrong slot changes the generated tokens."""

    def __init__(self, runner: FakeRunner, num_blocks: int) -> None:
        self.runner = runner
        self.num_blocks = num_blocks
        self.slots = [-1] * (num_blocks * runner.block_size)
        self.num_offloaded = 0
        self.num_restored = 0
        self.num_written_through = 0
        self.fences: list[tuple[int, int]] = []  # (steps launched, the copies' fence) of each copy

    def step_launched(self, index: int) -> None:
        self.num_launched = index

    def write_through(self, copies: Sequence[int], fence: int) -> None:
        self.num_written_through += sum(count for _, _, count in iter_runs(copies))
        self._copy_out(copies)

    def settle(self, reuse: bool) -> None:
        pass

    def _copy_out(self, copies: Sequence[int]) -> None:
        size = self.runner.block_size
        for block, slot, count in iter_runs(copies):
            self.slots[slot * size:(slot + count) * size] = self.runner.slots[block * size:(block + count) * size]

    def copy(self, offloads: Sequence[int], restores: Sequence[int], fence: int) -> None:
        self.fences.append((getattr(self, "num_launched", 0), fence))
        size = self.runner.block_size
        for block, slot, count in iter_runs(offloads):
            self.slots[slot * size:(slot + count) * size] = self.runner.slots[block * size:(block + count) * size]
            self.num_offloaded += count
        for slot, block, count in iter_runs(restores):
            self.runner.slots[block * size:(block + count) * size] = self.slots[slot * size:(slot + count) * size]
            self.num_restored += count


def _implements(runner: FakeRunner) -> LoadedRunner:
    """Type-checked by mypy (``mypy tests/fake_runner.py``): the fake has every member of the interface."""
    return runner
