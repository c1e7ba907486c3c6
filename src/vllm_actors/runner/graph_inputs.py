"""The decode graphs' static inputs, packed in one device buffer filled by one copy per step.

A decode step (one new token per sequence) replays a CUDA graph that reads its inputs from fixed
device tensors. Copying each input on its own costs one ``copy_`` call per tensor on the host's
critical path (six, then the sampler's per-row tensors). Here every static input is a
typed view into one byte buffer on the device; the host fills the same layout in a pinned buffer
(two in turn, so a step can be filled while the previous one's copy may still be queued; a set is
refilled only once its copy has run: ``staging.py``) and one non-blocking copy moves the bytes the
bucket needs. The block tables come last, so a small bucket
copies only its own rows of them. Where the tables are wide (a long ``max_model_len``: 62,688
blocks a row at 1M tokens) and the step's rows short, their rows' used columns travel compact
instead (``COMPACT_FACTOR``) and a device copy spreads them into the graph's table: a full
bucket's rows at that width were a 32 MB host fill and copy per decode step of 128 short requests.

The sampler's per-row inputs (inverse temperature, noise scale, Philox seed: ``GraphSampling``)
travel in the same copy, for the graphs that draw the tokens inside the graph. Where the attention
groups a verification step's rows (``queries_per_read`` above 1: ``verify_rows.py``), the rows' query
groups do too, and the graphs are captured reading them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_actors.actors.worker.step_data import BatchInput, GraphSampling
from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.runner.staging import Fence, StagingSets
from vllm_actors.runner.verify_rows import group_bounds

# (name, dtype, elements per row of the largest bucket): in buffer order, 8-byte fields first
_LAYOUT: tuple[tuple[str, torch.dtype, int], ...] = (
    ("input_ids", torch.long, 1),
    ("positions", torch.long, 1),
    ("slot_mapping", torch.long, 1),
    ("deferred", torch.long, 2),  # [2, largest]: flat index, source row
    ("seeds", torch.long, 1),
    ("inv_temperature", torch.float32, 1),
    ("noise", torch.float32, 1),
    ("seq_lens", torch.int32, 1),
    ("decode_groups", torch.int32, 2),  # [2, largest]: each row's query group's first and end row
)


# Tables travel compact where the bucket's full rows hold this many times the cells their used columns do,
# and are that wide at least (below, the one full copy costs less than the extra copies).
COMPACT_FACTOR = 4
COMPACT_MIN_CELLS = 1 << 16


def _offsets(largest: int) -> tuple[dict[str, int], int]:
    """Each field's byte offset (8-byte aligned), and where the block tables start."""
    offsets: dict[str, int] = {}
    offset = 0
    for name, dtype, per_row in _LAYOUT:
        offsets[name] = offset
        offset += largest * per_row * torch.tensor([], dtype=dtype).element_size()
        offset = (offset + 7) // 8 * 8
    return offsets, offset


def _views(buffer: torch.Tensor, largest: int, width: int) -> dict[str, torch.Tensor]:
    offsets, tables = _offsets(largest)
    views: dict[str, torch.Tensor] = {}
    for name, dtype, per_row in _LAYOUT:
        size = torch.tensor([], dtype=dtype).element_size()
        flat = buffer[offsets[name] : offsets[name] + largest * per_row * size].view(dtype)
        views[name] = flat.view(2, largest) if per_row == 2 else flat
    views["block_tables"] = buffer[tables : tables + largest * width * 4].view(torch.int32).view(largest, width)
    return views


_NO_GROUPS = BatchInput([], [], [], [], [], [])  # every row its own query group


class GraphInputs:
    """The static inputs of every decode graph (views of one device buffer) and their host side."""

    def __init__(self, largest: int, width: int, block_size: int, device: torch.device,
                 fence: Callable[[], Fence] | None = None, queries_per_read: int = 1) -> None:
        """``fence``: the staging sets' fences (``StagingSets``; default: CUDA events on a GPU);
        ``queries_per_read``: a verification step's rows of one sequence the attention serves with one
        read of its KV (``verify_rows.queries_per_read``); above 1 the graphs read the query groups."""
        self.largest = largest
        self.queries_per_read = queries_per_read
        self.width = width
        self.block_size = block_size
        _, tables_offset = _offsets(largest)
        self._tables_offset = tables_offset
        total = tables_offset + largest * width * 4
        pin = device.type == "cuda"
        self._device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        self.device = _views(self._device_bytes, largest, width)
        # the compact tables' landing place on the device (wide tables only: ``upload``; compact rows hold under
        # 1 / COMPACT_FACTOR of a full bucket's cells)
        self._compact = torch.zeros(largest * width // COMPACT_FACTOR, dtype=torch.int32, device=device) \
            if largest * width > COMPACT_MIN_CELLS else None

        def host_set() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            buffer = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
            return buffer, _views(buffer, largest, width)

        self._host = StagingSets(host_set, device, fence)
        # decode: every sequence's query starts one token after the previous one's, padded or not
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.device["slot_mapping"].fill_(-1)
        self.device["seq_lens"].fill_(1)
        self.device["decode_groups"].copy_(torch.from_numpy(group_bounds(_NO_GROUPS, largest).copy()))

    def for_bucket(self, size: int) -> dict[str, torch.Tensor]:
        """The graph inputs of a bucket of ``size`` rows (views: captured once, refilled per step)."""
        views = self.device
        return {
            "input_ids": views["input_ids"][:size],
            "positions": views["positions"][:size],
            "slot_mapping": views["slot_mapping"][:size],
            "query_start_loc": self.query_start_loc[: size + 1],
            "seq_lens": views["seq_lens"][:size],
            "block_tables": views["block_tables"][:size],
            "inv_temperature": views["inv_temperature"][:size],
            "noise": views["noise"][:size],
            "seeds": views["seeds"][:size],
            **({"decode_groups": views["decode_groups"][:, :size]} if self.queries_per_read > 1 else {}),
        }

    @staticmethod
    def meta(inputs: dict[str, torch.Tensor], size: int, max_model_len: int) -> AttentionMetadata:
        """The attention metadata a bucket's graph is captured with (over its static inputs)."""
        return AttentionMetadata(
            slot_mapping=inputs["slot_mapping"],
            query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            max_query_len=1,
            max_seq_len=max_model_len,  # an upper bound: the graph serves every length
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[max_model_len] * size,
            decode_groups=inputs.get("decode_groups"),
        )

    def upload(self, batch: BatchInput, bucket: int, sampling: GraphSampling | None) -> torch.Tensor | None:
        """Fill the host buffer for a decode ``batch`` padded to ``bucket`` rows (padded rows: slot
        -1, length 1, greedy), copy it to the device in one go; return the deferred pairs' device
        view ([2, k]) when the batch has deferred inputs."""
        num_seqs = len(batch.query_lens)
        host_bytes, host = self._host.acquire()
        positions = np.asarray(batch.positions, dtype=np.int64)
        blocks = batch.block_ids(np.arange(num_seqs), positions // self.block_size)

        ids = host["input_ids"].numpy()
        ids[:num_seqs] = batch.token_ids
        ids[num_seqs:bucket] = 0
        pos = host["positions"].numpy()
        pos[:num_seqs] = positions
        pos[num_seqs:bucket] = 0
        slots = host["slot_mapping"].numpy()
        slots[:num_seqs] = blocks * self.block_size + positions % self.block_size
        slots[num_seqs:bucket] = -1
        lens = host["seq_lens"].numpy()
        lens[:num_seqs] = batch.seq_lens
        lens[num_seqs:bucket] = 1
        used = min(batch.table_width(), self.width)
        compact = self._compact is not None and bucket * self.width > COMPACT_FACTOR * bucket * used + COMPACT_MIN_CELLS
        if compact:  # the rows' used columns, contiguous where the tables start (spread on the device below)
            table_view = host_bytes[self._tables_offset : self._tables_offset + bucket * used * 4].view(
                torch.int32).numpy().reshape(bucket, used)
            batch.copy_tables(table_view, used)
            table_view[num_seqs:bucket] = 0
        else:
            table_view = host["block_tables"].numpy()
            batch.copy_tables(table_view, self.width)
            table_view[:num_seqs, used:] = 0
            table_view[num_seqs:bucket] = 0
        if self.queries_per_read > 1:
            host["decode_groups"].numpy()[:, :bucket] = group_bounds(batch, bucket)
        if sampling is not None:
            inv = host["inv_temperature"].numpy()
            inv[:num_seqs] = sampling.inv_temperature
            inv[num_seqs:bucket] = 1.0
            noise = host["noise"].numpy()
            noise[:num_seqs] = sampling.noise
            noise[num_seqs:bucket] = 0.0
            seeds = host["seeds"].numpy()
            seeds[:num_seqs] = sampling.seeds
            seeds[num_seqs:bucket] = 0
        count = 0
        if batch.deferred is not None:
            count = len(batch.deferred.flat_index)
            pairs = host["deferred"].numpy()
            pairs[0, :count] = batch.deferred.flat_index
            pairs[1, :count] = batch.deferred.source_row
        if compact and self._compact is not None:  # beyond a row's used columns the graph's table keeps old ids, unread
            end = self._tables_offset + bucket * used * 4
            self._device_bytes[: self._tables_offset].copy_(host_bytes[: self._tables_offset], non_blocking=True)
            landed = self._compact[: bucket * used]
            landed.copy_(host_bytes[self._tables_offset : end].view(torch.int32), non_blocking=True)
            self.device["block_tables"][:bucket, :used].copy_(landed.view(bucket, used))
        else:
            used_bytes = self._tables_offset + bucket * self.width * 4
            self._device_bytes[:used_bytes].copy_(host_bytes[:used_bytes], non_blocking=True)
        self._host.enqueued()
        return self.device["deferred"][:, :count] if count else None


class DecodeGraph:
    """A captured decode graph and its output buffer."""

    def __init__(self, graph: torch.cuda.CUDAGraph, logits: torch.Tensor) -> None:
        self.graph = graph
        self.logits = logits  # the logits, or (graphs that sample) the chosen ids
