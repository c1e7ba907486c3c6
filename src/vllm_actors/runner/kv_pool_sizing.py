"""The KV pool's size and tensors (``ModelRunner``'s memory part): the blocks that
``gpu_memory_utilization`` leaves after the weights and the peak activations of a profiling pass of the
largest step (twice that with padded graphs: their pool holds one more), the same on every rank."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.kv_parallel import KvParallel
from vllm_actors.models.parallel import TensorParallel
from vllm_actors.models.pipeline import PipelineStage
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runner.staging import Fence
from vllm_actors.runner.step_inputs import StepStaging


class KvPoolSizing:
    """Mixed into ``ModelRunner``, whose attributes and methods these are."""

    config: EngineConfig
    device: torch.device
    model: Any
    local_config: ModelConfig
    kv_cache_dtype: torch.dtype
    block_size: int
    max_num_tokens: int
    tp: TensorParallel
    stage: PipelineStage
    kvp: KvParallel
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    max_model_len: int
    max_blocks_per_seq: int
    padded_graphs: bool
    _staging: StepStaging
    _profiling: bool

    def _new_staging(self, fence: Callable[[], Fence] | None = None) -> StepStaging:
        raise NotImplementedError

    def _run_eager(self, batch: BatchInput) -> torch.Tensor:
        raise NotImplementedError

    def _wants_padded_graphs(self) -> bool:
        raise NotImplementedError

    def capture_graphs(self) -> None:
        raise NotImplementedError

    def take_pool(self, num_blocks: int, max_model_len: int, enforce_eager: bool) -> None:
        """A draft model's pool, once the target sized its own: the same number of blocks (the
        same block ids); then its decode graphs (``draft_model.py``)."""
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        self._staging = self._new_staging()
        self.config = msgspec.structs.replace(self.config, enforce_eager=enforce_eager)
        self.padded_graphs = False
        self.capture_graphs()

    @property
    def bytes_per_block(self) -> int:
        """A block's bytes over every layer, a draft model's layers included (they share the block ids)."""
        mc = self.local_config
        element = torch.tensor([], dtype=self.kv_cache_dtype).element_size()
        own = 2 * len(self.model.stage_layers()) * self.block_size * mc.num_key_value_heads * mc.head_dim * element
        drafter = getattr(self, "drafter", None)
        return own + (drafter.bytes_per_block if drafter is not None else 0)

    def _choose_num_blocks(self, max_model_len: int) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            activations = self._profile_peak_activation_bytes(max_model_len)
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = 512 << 20  # CUDA graphs' pool, sampler buffers, allocator slack
            if self._wants_padded_graphs():
                reserve += activations  # the padded graphs' pool holds the largest step's activations
            budget = free - (1.0 - self.config.gpu_memory_utilization) * total - activations - reserve
        else:
            budget = self.config.resolved_cpu_kv_cache_bytes()
        # Every rank must hold the same pool (block ids are the same on every rank): the smallest;
        # under KV parallelism the pool is every KV-parallel rank's together.
        num_blocks = self.stage.min_int(self.tp.min_int(int(budget // self.bytes_per_block), self.device), self.device)
        num_blocks = self.kvp.min_int(num_blocks, self.device) * self.kvp.size
        if num_blocks < 1:
            raise ValueError(
                f"no memory is left for the KV cache (budget {budget / 2**20:.0f} MiB, "
                f"one block takes {self.bytes_per_block / 2**20:.2f} MiB)"
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_peak_activation_bytes(self, max_model_len: int) -> int:
        """Run the largest prefill step once (into a scratch cache) and measure its peak."""
        tokens = self.max_num_tokens
        lengths: list[int] = []
        while sum(lengths) < tokens:
            lengths.append(min(max_model_len, tokens - sum(lengths)))
        scratch_blocks = sum(math.ceil(n / self.block_size) for n in lengths)
        scratch = self._allocate_kv_cache(scratch_blocks)
        tables, next_block = [], 0
        for n in lengths:
            count = math.ceil(n / self.block_size)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        batch = BatchInput(
            token_ids=[0] * tokens,
            positions=[p for n in lengths for p in range(n)],
            query_lens=lengths,
            seq_lens=lengths,
            block_tables=tables,
            logits_indices=list(np.cumsum(lengths) - 1),
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        saved: Any = getattr(self, "kv_caches", None)
        self.kv_caches = scratch
        self._staging = self._new_staging()
        self._profiling = True
        self._run_eager(batch)
        self._profiling = False
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = saved
        del scratch
        torch.cuda.empty_cache()
        return int(peak)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.local_config
        shape = (self.kvp.local_blocks(num_blocks), self.block_size, mc.num_key_value_heads, mc.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for _ in self.model.stage_layers()
        ]
