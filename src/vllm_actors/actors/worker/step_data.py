"""What crosses the worker's files: a step's flattened batch, a request the worker holds, the rows
the sampler draws, and a step launched whose tokens are not read back yet.

The bottom of the worker folder: it imports no other worker module, and every other worker or
runner module takes these types from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from vllm_actors.protocol.events import StepStarted
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.messages import Logprobs, PromptLogprobs
from vllm_actors.protocol.sampling import SamplingParams

if TYPE_CHECKING:  # the type only: block_tables imports no torch, this module does
    from vllm_actors.actors.worker.block_tables import TableRows


@dataclass
class DeferredInputs:
    """Input ids still on the device: token ``flat_index[i]`` of the batch is ``source[source_row[i]]``
    (the ids the previous step sampled, not yet read back to the host)."""

    flat_index: list[int]
    source: torch.Tensor
    source_row: list[int]


@dataclass
class OverlapRows:
    """Decode rows launched before the drafting step they follow was read back (``spec_overlap``):
    row ``rows[i]`` (its flat token index and its sequence's, a decode step) was built as if all
    ``num_drafts[i]`` drafts of that request were accepted; on the device, with ``a`` its accepted
    count (``accepted[which[i]]``), its position, slot and sequence length move back by
    ``num_drafts[i] - a`` and its input becomes ``source[first_row[i] + a]`` (the target's draw there)."""

    rows: list[int]
    first_row: list[int]
    num_drafts: list[int]
    which: list[int]
    accepted: torch.Tensor  # the pending step's accepted count per sampler, on the device
    source: torch.Tensor  # the pending step's draws, a row per verified position, on the device


@dataclass
class BatchInput:
    token_ids: list[int]  # flattened new tokens of every scheduled sequence
    positions: list[int]
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step
    block_tables: list[list[int]]  # per sequence (the worker's own lists; test runners read these)
    logits_indices: list[int]  # flat positions whose logits are returned
    block_table_array: np.ndarray | None = None  # [B, width] int32: the same tables, gathered
    table_rows: TableRows | None = None  # the worker's array's rows, read in place (gathered on demand)
    deferred: DeferredInputs | None = None  # placeholders in token_ids to fill on the device
    loras: list[LoRARequest | None] | None = None  # per sequence, its LoRA adapter (None: no sequence has one)
    # decode rows of a verification step (runner/verify_rows.py): how many consecutive rows each of its
    # sequences became, in order; the attention reads a sequence's KV once for its rows (None: rows alone)
    row_groups: list[int] | None = None
    # run eagerly, never in a CUDA graph: a step with a request on borrowed KV (its attention calls out
    # to the lenders, runner/kv_borrowing.py)
    eager: bool = False
    # decode rows whose position and input come from the pending verification's accepted counts
    overlap: OverlapRows | None = None

    def table_array(self) -> np.ndarray:
        """The block tables as one [B, width] int32 array (``block_table_array`` when gathered)."""
        if self.block_table_array is not None:
            return self.block_table_array
        if self.table_rows is not None:
            self.block_table_array = self.table_rows.gather()
            return self.block_table_array
        tables = np.zeros((len(self.block_tables), max(len(t) for t in self.block_tables) or 1), dtype=np.int32)
        for row, table in enumerate(self.block_tables):
            tables[row, : len(table)] = table
        return tables

    def block_ids(self, sequences: np.ndarray, block_index: np.ndarray) -> np.ndarray:
        """The block id at ``block_index`` of each of ``sequences`` (int64), read in place where the batch
        has the worker's rows (``table_rows``)."""
        if self.table_rows is not None:
            return self.table_rows.blocks_at(sequences, block_index).astype(np.int64)
        return self.table_array()[sequences, block_index].astype(np.int64)

    def table_width(self) -> int:
        """The longest row's blocks (at least 1)."""
        if self.table_rows is not None:
            return self.table_rows.width
        if self.block_table_array is not None:
            return max(self.block_table_array.shape[1], 1)
        return max((len(table) for table in self.block_tables), default=0) or 1

    def copy_tables(self, view: np.ndarray, width: int) -> int:
        """The block tables into ``view[:B, :width]``; returns the columns written (the longest row's, within
        ``width``: the rest is the caller's to clear)."""
        if self.table_rows is not None:
            return self.table_rows.copy_into(view, width)
        tables = self.table_array()
        used = min(tables.shape[1], width)
        view[: len(tables), :used] = tables[:, :used]
        return used

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampled: the shape CUDA graphs are captured for."""
        return len(self.token_ids) == len(self.query_lens) == len(self.logits_indices)


@dataclass
class GraphSampling:
    """Per-row inputs of the fused sampling kernel for one decode step drawn inside its graph."""

    inv_temperature: list[float]
    noise: list[float]
    seeds: list[int]


@dataclass
class SamplingRow:
    params: SamplingParams
    num_output_tokens: int  # outputs before this one: the index of the token being drawn
    min_tokens_stop_ids: list[int]  # ids masked while num_output_tokens < min_tokens
    token_ids: Sequence[int] = ()  # prompt then outputs so far: penalties and bad words read them
    num_prompt_tokens: int = 0
    penalty_slot: int = -1  # its slot in the sampler's PenaltyPool (penalties read that, not token_ids)
    # A verification row: the drafts before its position, taken as drawn (its output ends with them:
    # the penalties, bad words and grammar of the row see them).
    drafted: Sequence[int] = ()

    def prompt_token_ids(self) -> Sequence[int]:
        return self.token_ids[: self.num_prompt_tokens]

    def output_token_ids(self) -> Sequence[int]:
        output = self.token_ids[self.num_prompt_tokens:]
        return [*output, *self.drafted] if self.drafted else output


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


class SpecCounts(Protocol):
    """A step's drafting counts (``verify.SpecStats``)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]


class RowGrammar(Protocol):
    """A constrained request's matcher, as the worker feeds it the tokens drawn."""

    active: bool  # masks the row's logits (False until a delayed grammar starts)

    def consume(self, token_id: int) -> None: ...

    def valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts``, in order from its state, it would take (the rest cannot be kept)."""
        ...


@dataclass
class WorkerRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    params: SamplingParams
    eos_token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    row: int = -1  # its row in the worker's BlockTableArray
    num_pending: int = 0  # tokens sampled by launched steps, not read back yet
    grammar: RowGrammar | None = None  # its structured-output matcher, when constrained
    penalty_slot: int = -1  # its slot in the sampler's PenaltyPool, when it sets penalties
    lora_request: LoRARequest | None = None  # its LoRA adapter

    @property
    def wants_prompt_logprobs(self) -> bool:
        # Not after a preemption: the prompt's logprobs were delivered on the first pass.
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def min_tokens_stop_ids(self) -> list[int]:
        if self.params.min_tokens == 0:
            return []
        eos = [] if self.params.ignore_eos else self.eos_token_ids
        return [*eos, *self.params.stop_token_ids]

    def sampling_row(self) -> SamplingRow:
        """What the sampler reads of it for the token being drawn."""
        return SamplingRow(self.params, self.num_output_tokens, self.min_tokens_stop_ids, self.token_ids,
                           self.num_prompt_tokens, self.penalty_slot)


@dataclass
class PromptSpan:
    """Rows of a step's logits that give a request's prompt logprobs."""

    request: WorkerRequest
    first_row: int  # first row of this span in the logits
    first_target: int  # prompt position whose logprob the first row gives
    count: int


@dataclass
class StepBatch:
    """A plan turned into the runner's batch, and who samples in it."""

    batch: BatchInput
    samplers: list[WorkerRequest]  # the requests that draw a token, in row order
    sample_rows: list[int]  # their rows of the logits
    spans: list[PromptSpan]  # the prompt-logprob rows
    # Speculative decoding: each sampler's drafted tokens (empty: none), its rows 1 + len after
    # its first in sample_rows; empty when nobody drafts.
    drafts: list[list[int]] = field(default_factory=list)


@dataclass
class PendingStep:
    """A step launched and its tokens drawn: on the host already, or on the device with their copy
    to the host on its way (``done``); read back by the worker at once or after the next launch."""

    step_id: int
    started_at: float | None  # the worker's clock at launch; None: nothing ran (no time reported)
    started: StepStarted
    samplers: list[WorkerRequest]  # the requests it sampled, in row order
    chosen: torch.Tensor | None  # [len(samplers)] token ids on the device: the next step's deferred inputs
    host: torch.Tensor | list[int]  # the ids on the host: valid once ``done`` is set or has completed
    done: torch.cuda.Event | None
    num_batched_tokens: int
    row_of: dict[str, int] = field(default_factory=dict)  # request id -> row in ``chosen``
    reset: bool = False  # the result of a reset plan
    logprobs: list[Logprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    grammars_fed: bool = False  # its tokens went to the constrained requests' matchers
    spec: SpecCounts | None = None  # speculative decoding: the step's drafted and accepted tokens
    num_drafted: dict[str, int] = field(default_factory=dict)  # requests short of their placeholders (StepResult)
    gpu_timed: bool = False  # timed on the GPU (gpu_timing): its result's execute_seconds is 0
    host_seconds: float = 0.0  # launch to read-back on the worker's clock, once read back
    drained: bool = False  # launched after the step in flight was read back (StepFinished.drained)
    # a verification read back later (spec_overlap): each sampler's drafts, the accepted counts on the device
    verifying: list[list[int]] | None = None
    accepted: torch.Tensor | None = None
    overlapped: int = 0  # rows fixed on the device by the pending verification's accepted counts
    overlapped_ids: list[str] = field(default_factory=list)  # placeholders dropped for that (StepResult)

    def ready(self) -> bool:
        """Whether the tokens are on the host (reading them would not wait)."""
        return self.done is None or self.done.query()

    def token_ids(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host if isinstance(self.host, list) else self.host.tolist()
