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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vllm_actors.kernels.choice import use_triton
from vllm_actors.kernels.kv_parallel import KvParallelAttention

if TYPE_CHECKING:
    from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention
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
        """Give ``model`` (a ``CausalLM``) the KV-parallel attention backend: on the GPU kernels where
        the attention setting picks Triton for the model's device (CUDA), else the torch loop."""
        if self.enabled:
            kernels = gpu_partial_attention(next(model.parameters()).device)
            windows = any(model.config.layer_sliding_window(layer) is not None
                          for layer in range(model.config.num_hidden_layers))
            model.attn_backend = KvParallelAttention(self.rank, self.size, block_size, self.all_gather, kernels,
                                                     capturable=not windows)

    def graphs_allowed(self, model: Any) -> bool:
        """Whether ``model``'s steps may be captured in CUDA graphs as far as KV parallelism goes."""
        return not self.enabled or bool(getattr(model.attn_backend, "capturable", False))

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


def gpu_partial_attention(device: torch.device) -> GpuPartialAttention | None:
    """The GPU kernels' partial attention for ``device`` (flash-attn 4 for long prefills where it
    runs), or None for the torch loop (``VLLM_ACTORS_ATTENTION``'s rule, ``kernels/choice.py``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    if not use_triton("VLLM_ACTORS_ATTENTION", True, device):
        return None
    from vllm_actors.kernels.flash_attn_prefill import flash_attn_prefill_for
    from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention

    return GpuPartialAttention(flash_attn_prefill_for(device))


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
