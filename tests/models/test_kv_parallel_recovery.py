"""Recovering a dead KV-parallel rank's share in the model (``actors/worker/lost_share.py``): the KVP
ranks of a tiny model in one process (a thread each, their per-layer all-gather a barrier), blocks
placed by the KV-cache manager's pool, a 2,000-token prompt prefilled in chunks beside a short one,
then decoded. One rank is then lost: a fresh model takes its place with a cache of noise, as a
respawned rank's. One recovery step recomputes only the positions of its blocks (each run of them a
sequence on its request's table), the survivors' caches untouched, and decoding goes on: greedy
tokens identical to transformers' in float32, about 1/K of the computed tokens recomputed. Without
the recovery step the next logits are wrong (the test sees the loss)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TP_LLAMA_SHAPE, TP_QWEN3_SHAPE
from tests.engine.test_correctness import reference_generate
from tests.support.tiny_models import build_checkpoint
from vllm_actors.actors.kv_cache_manager.block_pool import BlockPool
from vllm_actors.actors.worker.lost_share import HeldRequest, recovery_batch
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.kernels.attention import build_attention_metadata
from vllm_actors.kernels.kv_parallel import KvParallelAttention
from vllm_actors.models.loader import load_model

BLOCK = 16
LOCAL_BLOCKS = 80  # per rank
MAX_TOKENS = 8
BEFORE_LOSS = 3  # tokens decoded before the rank is lost
CHUNK = 256


class ThreadGather:
    """The ranks' all-gather between threads: each puts its tensor in its slot, all read them stacked."""

    def __init__(self, size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def exchange(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def gather(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x
            self.barrier.wait()
            stacked = torch.stack([slot for slot in self.slots if slot is not None])
            self.barrier.wait()  # every rank has read the slots before any writes the next
            return stacked

        return gather


@dataclass
class Request:
    token_ids: list[int]
    num_prompt: int
    table: list[int] = field(default_factory=list)
    computed: int = 0

    def held(self) -> HeldRequest:
        return HeldRequest(self.token_ids, self.table, self.computed)


class Ranks:
    """K KV-parallel ranks of one checkpoint, each its model and local cache."""

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self.gather = ThreadGather(size)
        self.pool = BlockPool(LOCAL_BLOCKS * size, ranks=size)
        self.models: list[Any] = [None] * size
        self.caches: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(size)]
        for rank in range(size):
            self.start(rank, seed=rank)

    def start(self, rank: int, seed: int) -> None:
        """A rank (again): its model loaded, its cache noise (a slot never written shows in the logits)."""
        model, config = load_model(str(self.path), torch.float32, torch.device("cpu"))
        model.attn_backend = KvParallelAttention(rank, self.size, BLOCK, self.gather.exchange(rank))
        generator = torch.Generator().manual_seed(100 + seed)
        shape = (LOCAL_BLOCKS, BLOCK, config.num_key_value_heads, config.head_dim)
        self.models[rank] = model
        self.caches[rank] = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                             for _ in range(config.num_hidden_layers)]

    def run(self, batch: BatchInput) -> torch.Tensor:
        """One step on every rank (a thread each); rank 0's logits of ``batch.logits_indices``."""
        meta = build_attention_metadata(batch.query_lens, batch.seq_lens, batch.block_tables, BLOCK)
        ids = torch.tensor(batch.token_ids)
        positions = torch.tensor(batch.positions)
        results: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                with torch.no_grad():
                    hidden = self.models[rank](ids, positions, meta, self.caches[rank])
                    results[rank] = self.models[rank].compute_logits(hidden[batch.logits_indices])
            except BaseException as error:  # noqa: BLE001 - re-raised by the test's thread
                errors.append(error)
                self.gather.barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results[0]

    def step(self, requests: list[Request], counts: list[int]) -> list[int | None]:
        """Each request's next ``counts[i]`` tokens; the greedy token of each that reaches its end."""
        batch = BatchInput([], [], [], [], [], [])
        for request, count in zip(requests, counts, strict=True):
            end = request.computed + count
            need = -(-end // BLOCK) - len(request.table)
            if need > 0:
                request.table.extend(self.pool.allocate(need, first_index=len(request.table)))
            batch.token_ids.extend(request.token_ids[request.computed:end])
            batch.positions.extend(range(request.computed, end))
            batch.query_lens.append(count)
            batch.seq_lens.append(end)
            batch.block_tables.append(request.table)
            batch.logits_indices.append(len(batch.token_ids) - 1)
        logits = self.run(batch)
        drawn: list[int | None] = []
        for row, (request, count) in enumerate(zip(requests, counts, strict=True)):
            request.computed += count
            drawn.append(int(logits[row].argmax()) if request.computed == len(request.token_ids) else None)
        return drawn


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(2000)], [rng.randrange(500) for _ in range(45)]]


def _prefill(ranks: Ranks, requests: list[Request]) -> None:
    """The long prompt in chunks, the short one whole in the first, beside it."""
    long, short = requests
    first = True
    while long.computed < long.num_prompt:
        count = min(CHUNK, long.num_prompt - long.computed)
        batch = [long, short] if first else [long]
        drawn = ranks.step(batch, [count, short.num_prompt] if first else [count])
        for request, token in zip(batch, drawn, strict=True):
            if token is not None:
                request.token_ids.append(token)
        first = False


def _decode(ranks: Ranks, requests: list[Request]) -> torch.Tensor:
    """One decode step of every request; their logits."""
    batch = BatchInput([], [], [], [], [], [])
    for request in requests:
        end = request.computed + 1
        if -(-end // BLOCK) > len(request.table):
            request.table.extend(ranks.pool.allocate(1, first_index=len(request.table)))
        batch.token_ids.append(request.token_ids[request.computed])
        batch.positions.append(request.computed)
        batch.query_lens.append(1)
        batch.seq_lens.append(end)
        batch.block_tables.append(request.table)
        batch.logits_indices.append(len(batch.token_ids) - 1)
    return ranks.run(batch)


def _advance(requests: list[Request], logits: torch.Tensor) -> None:
    for request, row in zip(requests, logits, strict=True):
        request.computed += 1
        request.token_ids.append(int(row.argmax()))


@pytest.mark.parametrize(("arch", "size", "dead"), [("qwen3", 2, 1), ("llama", 3, 0)])
def test_recomputing_the_dead_ranks_share_gives_transformers_tokens(tmp_path: Path, arch: str, size: int,
                                                                    dead: int) -> None:
    shape = (TP_QWEN3_SHAPE if arch == "qwen3" else TP_LLAMA_SHAPE) | {"max_position_embeddings": 4096,
                                                                       "num_hidden_layers": 2}
    path = build_checkpoint(tmp_path, arch, tie_word_embeddings=arch == "qwen3", shape=shape)
    prompts = _prompts(size)
    want = [tokens for tokens, _ in reference_generate(path, prompts, max_tokens=MAX_TOKENS)]
    ranks = Ranks(path, size)
    requests = [Request(list(prompt), len(prompt)) for prompt in prompts]
    _prefill(ranks, requests)
    for _ in range(BEFORE_LOSS - 1):
        _advance(requests, _decode(ranks, requests))

    ranks.start(dead, seed=size + 7)  # the rank is lost: a fresh process's model, its cache noise
    lost = _decode(ranks, requests)  # what decoding on without recovery reads (its K/V is written again below)
    survivors = {rank: [tensor.clone() for pair in ranks.caches[rank] for tensor in pair]
                 for rank in range(size) if rank != dead}
    recovery = recovery_batch([request.held() for request in requests], BLOCK, dead, size)
    ranks.run(BatchInput(recovery.token_ids, recovery.positions, recovery.query_lens, recovery.seq_lens,
                         recovery.block_tables, []))  # nothing sampled
    for rank, before in survivors.items():  # the survivors' K/V is all still there: they write none of it
        after = [tensor for pair in ranks.caches[rank] for tensor in pair]
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), f"rank {rank} wrote its cache"
    recovered = _decode(ranks, requests)
    assert (recovered - lost).abs().max().item() > 1e-2, "losing the rank's cache changed nothing: no test"
    _advance(requests, recovered)
    while len(requests[0].token_ids) - requests[0].num_prompt < MAX_TOKENS:
        _advance(requests, _decode(ranks, requests))

    got = [request.token_ids[request.num_prompt:] for request in requests]
    assert got == want
    computed = sum(len(prompt) for prompt in prompts) + 2 * (BEFORE_LOSS - 1)
    recomputed = sum(recovery.query_lens)
    assert recomputed == len(recovery.token_ids)
    # about 1/K of what was computed: one block in K, plus at most one block per request of slack
    assert 0 < recomputed <= computed / size + BLOCK * len(prompts), (recomputed, computed)
