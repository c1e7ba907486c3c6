"""Tensor parallelism (Megatron-style): a rank's place in the group, its shard of each weight, and
the collectives the sharded model runs.

Each of ``size`` ranks holds:

- ``q_proj`` and ``gate_proj``/``up_proj`` split by output rows (column-parallel): heads
  ``[rank * H/size, (rank + 1) * H/size)`` and the same slice of the intermediate size;
- ``k_proj``/``v_proj``: ``KV/size`` KV heads each, or, when there are fewer KV heads than ranks,
  one KV head replicated on ``size/KV`` consecutive ranks (rank ``r`` holds head ``r // (size/KV)``:
  the one its query heads use);
- ``o_proj`` and ``down_proj`` split by input columns (row-parallel): each rank's partial sum is
  all-reduced once per layer and projection (a bias is added on rank 0 only, so it counts once);
- the embedding and the LM head split by vocabulary rows, ``ceil(V/size)`` per rank (the last one
  padded with zero rows): a token outside a rank's range embeds to zeros there and one all-reduce
  sums the ranks; the logits are all-gathered and cut back to V columns;
- norms (and Qwen3's per-head q/k norms) replicated;
- in a mixture-of-experts layer, every expert: a slice of its intermediate size, as the dense MLP
  (gate/up rows, down columns; vLLM's TP MoE); the router replicated.

``ShardLayout.slice_of`` names the slice of a checkpoint tensor a rank loads, so a loader can read
just that (safetensors' ``get_slice``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from vllm_actors.envs import Envs
from vllm_actors.kernels.embedding import shard_embedding
from vllm_actors.kernels.fused_ops import rms_norm
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.fused_all_reduce import FusedAllReduceNorm, fused_from_env
from vllm_actors.models.moe_config import expert_split


@dataclass(frozen=True)
class TensorParallel:
    """A rank of a tensor-parallel group (``size == 1``: no group, every collective a no-op)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)
    symm: SymmMemAllReduce | None = None  # VLLM_ACTORS_TP_ALLREDUCE=symm_mem: all-reduces up to a size
    fused: FusedAllReduceNorm | None = None  # all-reduce + add + RMSNorm in one kernel (GPUs)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (in place through NCCL, gloo and the two-shot all-reduce; a new
        tensor through the one-shot one): use the returned tensor."""
        if not self.enabled:
            return x
        if self.symm is not None and self.symm.fits(x):
            return self.symm(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, slot: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: this rank's partial sum; returns (RMSNorm(sum + residual) * weight, sum + residual),
        in one kernel where ``fused`` takes it (``slot``: the call site's, see `fused_all_reduce.py`),
        else the all-reduce then the fused add + norm."""
        if self.fused is not None and self.fused.fits(x):
            return self.fused(x, weight, eps, residual, slot)
        return rms_norm(self.all_reduce(x), weight, eps, residual)

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] per rank -> [N, size * C], rank r's columns at ``[r*C, (r+1)*C)``."""
        if not self.enabled:
            return x
        x = x.contiguous()
        if x.device.type == "cuda":  # one buffer, graph-capturable
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            if x.shape[0] == 1:  # one row: [size, 1, C] is already [1, size * C] (no concatenation kernel)
                return out.view(1, self.size * x.shape[1])
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` on every rank, in place (``src`` within the group: under pipeline
        parallelism a stage's group holds other global ranks)."""
        if self.enabled:
            dist.broadcast(x, src=dist.get_global_rank(self.group, src), group=self.group)
        return x

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over the ranks."""
        return min_over_group(value, device, self.group) if self.enabled else value


def min_over_group(value: int, device: torch.device, group: Any) -> int:
    """The smallest ``value`` over the ranks of ``group`` (an all-reduce MIN)."""
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


# Checkpoint names (suffixes) by how they are split: dim 0 (column-parallel) or dim 1 (row-parallel).
_QUERY = ("self_attn.q_proj",)
_KEY_VALUE = ("self_attn.k_proj", "self_attn.v_proj")
_COLUMN_MLP = ("mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")
_VOCAB = ("model.embed_tokens", "lm_head")


class Part(NamedTuple):
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a tensor ``full`` long there."""

    dim: int
    start: int
    stop: int
    full: int


@dataclass(frozen=True)
class ShardLayout:
    """What one rank holds of a model (``check`` raises for shapes that cannot be split)."""

    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, size = self.config, self.size
        if c.num_attention_heads % size:
            raise ValueError(f"tensor_parallel_size {size} must divide num_attention_heads "
                             f"({c.num_attention_heads})")
        kv = c.num_key_value_heads
        if kv >= size and kv % size:
            raise ValueError(f"tensor_parallel_size {size} must divide num_key_value_heads ({kv})")
        if kv < size and size % kv:
            raise ValueError(f"num_key_value_heads ({kv}) must divide tensor_parallel_size {size} "
                             "(fewer KV heads than ranks: each is replicated on size/KV ranks)")
        if c.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} must divide intermediate_size ({c.intermediate_size})")
        if c.moe_layers and c.moe_intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the experts' intermediate size "
                             f"({c.moe_intermediate_size})")
        if not 0 <= self.rank < size:
            raise ValueError(f"rank {self.rank} outside a group of {size}")

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        kv = self.config.num_key_value_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # replicated: the head this rank's query heads read

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return math.ceil(self.config.vocab_size / self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Rows of the checkpoint's vocabulary this rank holds (the last rank may hold fewer)."""
        return max(0, min(self.config.vocab_size, self.vocab_start + self.vocab_per_rank) - self.vocab_start)

    def local_config(self) -> ModelConfig:
        """The model config of this rank's modules (its heads, intermediate size and vocabulary)."""
        if self.size == 1:
            return self.config
        return dataclasses.replace(
            self.config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.config.moe_intermediate_size // self.size,
            vocab_size=self.vocab_per_rank,
        )

    def slice_of(self, name: str) -> Part | None:
        """The part of the checkpoint tensor ``name`` this rank loads; None: all of it (replicated,
        or ``size == 1``). Row-parallel biases: None here, see ``rank0_only``."""
        if self.size == 1:
            return None
        c, module, kind = self.config, *name.rpartition(".")[::2]
        if c.quantization is not None and kind == c.quantization.scale_name:  # an FP8 weight's scales
            return self._scale_part(self.slice_of(f"{module}.weight"), name)
        d = c.head_dim
        if module.endswith(_QUERY):
            return Part(0, self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d, c.q_size)
        if module.endswith(_KEY_VALUE):
            return Part(0, self.first_kv_head * d, (self.first_kv_head + self.num_kv_heads) * d, c.kv_size)
        split = expert_split(name)
        if split is not None:  # one expert's gate, up or down: its slice of the experts' intermediate size
            width, full = c.moe_intermediate_size // self.size, c.moe_intermediate_size
            return Part(0 if split == "column" else 1, self.rank * width, (self.rank + 1) * width, full)
        inter = self.intermediate_size
        if module.endswith(_COLUMN_MLP):
            return Part(0, self.rank * inter, (self.rank + 1) * inter, c.intermediate_size)
        if module.endswith(_ROW) and kind == "weight":
            width, full = (self.num_heads * d, c.q_size) if module.endswith("o_proj") else (inter, c.intermediate_size)
            return Part(1, self.rank * width, (self.rank + 1) * width, full)
        if module in _VOCAB:
            return Part(0, self.vocab_start, self.vocab_start + self.vocab_rows, c.vocab_size)
        return None

    def _scale_part(self, weight_part: Part | None, name: str) -> Part | None:
        """The part of an FP8 weight's scales that goes with ``weight_part`` of the weight: the same
        rows of a per-channel scale (all of it for a column split), whole blocks of a block scale."""
        scheme = self.config.quantization
        if weight_part is None or scheme is None:
            return None
        if scheme.block_size is None:
            return weight_part if weight_part.dim == 0 else None
        block = scheme.block_size[weight_part.dim]
        start, stop, full = weight_part.start, weight_part.stop, weight_part.full
        if start % block or (stop % block and stop != full):
            raise ValueError(f"{name}: this rank's rows/columns [{start}, {stop}) of the weight are not whole "
                             f"blocks of {block} (weight_block_size {list(scheme.block_size)}); choose a "
                             "tensor_parallel_size that splits it into whole blocks")
        return Part(weight_part.dim, start // block, -(-stop // block), -(-full // block))

    def rank0_only(self, name: str) -> bool:
        """A row-parallel bias: added once, by rank 0 (zeros elsewhere)."""
        module, _, kind = name.rpartition(".")
        return self.size > 1 and module.endswith(_ROW) and kind == "bias"


def vocab_parallel_embedding(input_ids: torch.Tensor, weight: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """Embed with this rank's rows of the table; ids it does not hold give zeros. This is the rank's
    partial sum: the caller all-reduces it (with the first norm, ``all_reduce_rms_norm``)."""
    if layout.size == 1:
        return torch.nn.functional.embedding(input_ids, weight)
    return shard_embedding(input_ids, weight[: layout.vocab_per_rank], layout.vocab_start)  # one kernel on GPUs


SYMM_MAX_BYTES = 8 << 20  # all-reduces above it go through NCCL (the symmetric buffer's size)
NO_MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"  # the two-shot needs no NVLink multicast: kept off


class SymmMemAllReduce:
    """All-reduces of at most ``max_bytes`` through torch's symmetric memory, over NVLink without
    multicast. The input is copied into a buffer every rank maps (allocated and exchanged on first
    use: a collective, which every rank reaches with the same step), then either
    - ``two_shot`` (``symm_mem.two_shot_all_reduce_``): each rank sums its 1/N of the buffer from
      its peers' copies, then gathers the others' sums, in place; the result is copied back into
      the input, since the next all-reduce reuses the buffer; or
    - ``one_shot`` (``symm_mem.one_shot_all_reduce``): each rank reads every peer's whole buffer.
    In CUDA graphs on NVLink (``benchmarks/allreduce.py``) two-shot beat one-shot and NCCL from
    8 KiB to 2 MiB."""

    def __init__(self, group: Any, max_bytes: int, method: str = "two_shot", min_bytes: int = 0) -> None:
        if method not in ("two_shot", "one_shot"):
            raise ValueError(f"method must be 'two_shot' or 'one_shot', got {method!r}")
        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes  # below it NCCL's single kernel beats the copy in, the two shots and the copy out
        self.method = method
        self.buffer: torch.Tensor | None = None

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cuda" and self.min_bytes <= x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._symmetric_memory as symm_mem

        if self.buffer is None or self.buffer.dtype != x.dtype:
            self.buffer = symm_mem.empty(self.max_bytes // x.element_size(), dtype=x.dtype, device=x.device)
            symm_mem.rendezvous(self.buffer, self.group_name)
        staged = self.buffer[: x.numel()]
        staged.copy_(x.reshape(-1))
        if self.method == "one_shot":
            return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view(x.shape)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
        return x.copy_(staged.view(x.shape))


def symm_all_reduce_from_env(environ: Mapping[str, str] | None, group: Any, on_cuda: bool) -> SymmMemAllReduce | None:
    """The all-reduce ``VLLM_ACTORS_TP_ALLREDUCE`` asks for (None: NCCL or gloo for every size);
    ``environ`` None: this process's environment.

    The default, ``symm_mem``: the two-shot all-reduce over symmetric memory for all-reduces of
    ``VLLM_ACTORS_TP_SYMM_MIN_BYTES`` (64 KiB) to ``SYMM_MAX_BYTES`` (every batched decode step),
    NCCL for the rest: more throughput than NCCL alone (``benchmarks/RESULTS.md``)."""
    settings = Envs(environ)
    choice = settings.VLLM_ACTORS_TP_ALLREDUCE
    if choice == "nccl" or not on_cuda:
        return None
    return SymmMemAllReduce(group, SYMM_MAX_BYTES, "one_shot" if choice == "symm_mem_one_shot" else "two_shot",
                            settings.VLLM_ACTORS_TP_SYMM_MIN_BYTES)


TP_TIMEOUT = timedelta(minutes=10)  # a collective that waits this long gives up (a rank is gone)


def join_group(rank: int, size: int, init_method: str, device: str, pipeline_size: int = 1) -> TensorParallel:
    """Join the ``size`` ranks of a tensor-parallel group at ``init_method`` (a ``file://`` path in
    the run directory or a ``tcp://`` address the supervisor handed out): NCCL where the engine runs
    on CUDA (rank ``r`` on GPU ``r``), gloo on the CPU. ``size == 1``: no group. ``pipeline_size``:
    groups of ``size`` ranks each, pipeline stages or KV-parallel ranks (``rank`` is then global,
    ``group * size + tp_rank``): one world of every rank (``dist.group.WORLD``: the stages'
    point-to-point), one tensor-parallel group per stage or KV-parallel rank."""
    world = size * pipeline_size
    if world == 1:
        return TensorParallel()
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        torch.cuda.set_device(rank)
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", rank)} if on_cuda else {}
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=TP_TIMEOUT, **kwargs)
    group = dist.group.WORLD
    if pipeline_size > 1:  # every rank creates every stage's group, in the same order
        groups = [dist.new_group(list(range(stage * size, (stage + 1) * size))) for stage in range(pipeline_size)]
        group = groups[rank // size]
    if size == 1:
        return TensorParallel()
    if on_cuda:
        os.environ.setdefault(NO_MULTICAST_ENV, "1")  # read when the first symmetric buffer is allocated
    symm = symm_all_reduce_from_env(None, group, on_cuda)
    fused = fused_from_env(None, group, torch.device("cuda", rank) if on_cuda else None)
    return TensorParallel(rank=rank % size, size=size, group=group, symm=symm, fused=fused)
