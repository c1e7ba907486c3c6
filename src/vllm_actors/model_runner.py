"""Model runner: the model's weights, the paged KV cache tensors, and one forward pass per step.

The worker hands it flattened batches (token ids, positions, block tables); it builds the
attention metadata, runs the model and returns the logits of the positions that were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from vllm_actors.config import EngineConfig
from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.model_config import ModelConfig
from vllm_actors.models.loader import load_model

log = structlog.get_logger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """'auto' is float32 on CPU (exact, and fast enough for small models); on a GPU it is the
    checkpoint's half type, with float32 checkpoints run in bfloat16 (as vLLM does)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return _DTYPES[checkpoint_dtype]
    return torch.bfloat16


@dataclass
class BatchInput:
    token_ids: list[int]  # flattened new tokens of every scheduled sequence
    positions: list[int]
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step
    block_tables: list[list[int]]
    logits_indices: list[int]  # flat positions whose logits are returned


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.model_config = ModelConfig.from_path(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        torch.manual_seed(config.seed)
        self.model, _ = load_model(config.model, self.dtype, self.device, config.load_format, config.seed)
        self.block_size = config.block_size
        self.num_blocks = self._choose_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        log.info(
            "model_runner_ready",
            model=config.model,
            device=str(self.device),
            dtype=str(self.dtype),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )

    @property
    def bytes_per_block(self) -> int:
        mc = self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * element

    def _choose_num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1.0 - self.config.gpu_memory_utilization) * total
        else:
            budget = self.config.resolved_cpu_kv_cache_bytes()
        num_blocks = int(budget // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError(
                f"no memory is left for the KV cache (budget {budget / 2**20:.0f} MiB, "
                f"one block takes {self.bytes_per_block / 2**20:.2f} MiB)"
            )
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.model_config
        shape = (num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(mc.num_hidden_layers)
        ]

    @torch.inference_mode()
    def execute(self, batch: BatchInput) -> torch.Tensor:
        """Run one forward pass; return float32 logits of ``batch.logits_indices`` rows."""
        device = self.device
        positions = torch.tensor(batch.positions, dtype=torch.long)
        block_tables = self._pad_block_tables(batch.block_tables)
        slot_mapping = self._slot_mapping(batch, block_tables, positions)
        query_start = torch.zeros(len(batch.query_lens) + 1, dtype=torch.int32)
        query_start[1:] = torch.tensor(batch.query_lens, dtype=torch.int32).cumsum(0)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            query_start_loc=query_start.to(device, non_blocking=True),
            seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            block_tables=block_tables.to(device, non_blocking=True),
            max_query_len=max(batch.query_lens),
            max_seq_len=max(batch.seq_lens),
            query_lens_cpu=list(batch.query_lens),
            seq_lens_cpu=list(batch.seq_lens),
        )
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long).to(device, non_blocking=True)
        hidden = self.model(input_ids, positions.to(device, non_blocking=True), meta, self.kv_caches)
        index = torch.tensor(batch.logits_indices, dtype=torch.long, device=device)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    @staticmethod
    def _pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
        width = max((len(table) for table in tables), default=0) or 1
        padded = torch.zeros((len(tables), width), dtype=torch.int32)
        for row, table in enumerate(tables):
            if table:
                padded[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        return padded

    def _slot_mapping(self, batch: BatchInput, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        sequence_of_token = torch.repeat_interleave(
            torch.arange(len(batch.query_lens)), torch.tensor(batch.query_lens)
        )
        blocks = block_tables[sequence_of_token, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size
