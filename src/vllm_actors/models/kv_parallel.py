"""KV parallelism: a worker's place among the KV-parallel ranks of its replica, their all-gather, and
the attention backend that spreads each request's KV over them (``kernels/kv_parallel.py``).

``K`` KV-parallel ranks of ``T`` tensor-parallel ranks each: global rank ``g`` is TP rank ``g % T``
of KV-parallel rank ``g // T`` (on GPU ``g``). Every KV-parallel rank holds the whole model (its TP
group shares it as usual) and its own pool of blocks; the ranks of one KV-parallel group are those
with the same TP rank (they hold the same heads), and they exchange each layer's partial attention.
Global rank 0 samples and broadcasts the chosen ids to every rank of the replica (``WorldRanks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_actors.kernels.kv_parallel import KvParallelAttention
from vllm_actors.models.parallel import min_over_group


@dataclass(frozen=True)
class KvParallel:
    """This worker's KV-parallel rank (``size == 1``: none; every block is its own)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the ranks with this worker's TP rank
    global_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order: [size, *x.shape]."""
        x = x.contiguous()
        if x.device.type == "cuda":
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.stack(parts)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the KV-parallel ranks."""
        return min_over_group(value, device, self.group) if self.enabled else value

    def local_blocks(self, num_blocks: int) -> int:
        """Blocks of this rank's own cache for a pool of ``num_blocks`` over every rank."""
        return -(-num_blocks // self.size)

    def install(self, model: Any, block_size: int) -> None:
        """Give ``model`` (a ``CausalLM``) the KV-parallel attention backend."""
        if self.enabled:
            model.attn_backend = KvParallelAttention(self.rank, self.size, block_size, self.all_gather)

    def world_ranks(self) -> WorldRanks:
        return WorldRanks(rank=self.global_rank, size=self.world_size)


@dataclass(frozen=True)
class WorldRanks:
    """Every rank of a KV-parallel replica as the worker sees them (``actors/worker/ranks.Ranks``):
    global rank 0 samples and broadcasts the ids, which every rank needs as its next inputs."""

    rank: int
    size: int
    enabled: bool = True

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(x, src=src)
        return x


def join_kv_parallel(global_rank: int, tp_size: int, kv_size: int) -> KvParallel:
    """This rank's KV-parallel group, once the world is joined (``parallel.join_group``): every rank
    creates every group, in the same order (one per TP rank)."""
    if kv_size == 1:
        return KvParallel()
    world = tp_size * kv_size
    groups = [dist.new_group([tp_rank + k * tp_size for k in range(kv_size)]) if tp_size > 1 else dist.group.WORLD
              for tp_rank in range(tp_size)]
    return KvParallel(rank=global_rank // tp_size, size=kv_size, group=groups[global_rank % tp_size],
                      global_rank=global_rank, world_size=world)
