"""The GPU engine as the worker's state machine sees it: everything it uses of the model runner,
the sampler and the grammars, declared here and implemented in ``vllm_actors.runner`` (and by the
tests' fake runner)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from vllm_actors.actors.worker.ranks import Ranks
from vllm_actors.actors.worker.step_data import (
    BatchInput,
    GraphSampling,
    RowGrammar,
    SampleResult,
    SamplingRow,
    WorkerRequest,
)
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.sampling import SamplingParams, StructuredOutputs


class Runner(Protocol):
    """One forward pass per step over the KV cache (``runner.model_runner.ModelRunner``)."""

    @property
    def supports_deferred_inputs(self) -> bool:
        """Whether ``execute`` fills ``BatchInput.deferred`` from the device (deferred steps need it)."""
        ...

    @property
    def tp(self) -> Ranks: ...

    @property
    def num_blocks(self) -> int:
        """The KV pool's size: a plan's block ids are checked against it."""
        ...

    @property
    def max_blocks_per_seq(self) -> int | None:
        """The widest block table; the worker then keeps its tables in one array (None: lists only)."""
        ...

    def execute(self, batch: BatchInput) -> torch.Tensor:
        """The logits of ``batch.logits_indices``, one row each (valid until the next step)."""
        ...

    def samples_in_graph(self, batch: BatchInput) -> bool:
        """Whether ``execute_sampled`` can run this step."""
        ...

    def execute_sampled(self, batch: BatchInput, sampling: GraphSampling) -> torch.Tensor:
        """Run a decode step and draw its tokens in one go; the chosen ids, on the device."""
        ...


class HostTierCopies(Protocol):
    """The host KV tier's memory and its copies (``runner.host_kv_tier.HostKvTier``)."""

    @property
    def num_blocks(self) -> int: ...

    def copy(self, offloads: Sequence[int], restores: Sequence[int], fence: int) -> None:
        """A plan's block copies (runs), offloads first, done before the next forward pass reads the
        KV, and after step ``fence`` (``step_launched``'s index; 0: none) is done."""
        ...

    def step_launched(self, index: int) -> None:
        """A step's forward pass was queued (the copies' fences name steps by this index)."""
        ...

    def write_through(self, copies: Sequence[int], fence: int) -> None:
        """Copies (GPU block, slot, count) of blocks step ``fence`` writes, made after it."""
        ...

    def settle(self, reuse: bool) -> None:
        """Before a forward pass: wait for the write-throughs it must (all of them: ``reuse``)."""
        ...


class PenaltySlots(Protocol):
    """The sampler's per-request penalty counts on the device (``runner.penalty_pool.PenaltyPool``)."""

    def add(self, request_id: str, prompt: Sequence[int], outputs: Sequence[int]) -> int: ...

    def remove(self, request_id: str) -> None: ...

    def clear(self) -> None: ...

    def count_kept(self, slots: Sequence[int], token_ids: Sequence[int]) -> None:
        """Count each slot's token (a verification's kept ones)."""
        ...


class TokenSampler(Protocol):
    """Draws each row's token from its logits (``runner.sampler.Sampler``)."""

    @property
    def penalties(self) -> PenaltySlots: ...

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], count: bool = True) -> SampleResult:
        """The chosen ids on the host, with the logprobs the rows ask for (``count``: as ``draw``'s)."""
        ...

    def draw(self, logits: torch.Tensor, rows: list[SamplingRow], count: bool = True) -> torch.Tensor:
        """The chosen ids, left on the device; ``count``: the penalised rows' ids counted in their
        slots (not a verification's read back at once: the worker counts the kept ones)."""
        ...

    def follow_draw(self, rows: list[SamplingRow]) -> None:
        """Keep the draw keys in step with rank 0's without drawing (tensor-parallel ranks above 0)."""
        ...

    def graph_params(self, rows: list[SamplingRow]) -> GraphSampling | None:
        """The inputs of a draw inside a decode graph; None when a row needs more."""
        ...

    def needs_host(self, params: SamplingParams) -> bool:
        """Whether a row's draw needs the host (logprobs): its step is read back at once."""
        ...


class GrammarSource(Protocol):
    """Structured outputs (``runner.grammar.Grammars``): a matcher per constrained request, compiled
    off the step's thread; the constrained rows' logits masked before the draw."""

    def start(self, spec: StructuredOutputs, replay: Sequence[int] = ()) -> RowGrammar: ...

    def mask(self, logits: torch.Tensor, rows: Sequence[Any], row_index: list[int],
             drafted: Sequence[Sequence[int]] | None = None) -> None: ...


class Proposer(Protocol):
    """Drafts made in the worker (``draft_model.DraftProposer``, ``eagle3.Eagle3Proposer``): a plan's
    ``WORKER_DRAFT`` placeholders filled in just before the step runs."""

    def propose(self, plan: StepPlan, requests: Mapping[str, WorkerRequest]) -> StepPlan: ...

    def forget(self, request_id: str) -> None: ...

    def clear(self) -> None: ...
