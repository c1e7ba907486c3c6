"""``build_worker``: a worker over its GPU engine, from the engine's configuration, and what the
worker reports when ready (the process entry point publishes it; the in-process engine reads it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from vllm_actors.actors.worker.draft_model import DraftProposer
from vllm_actors.actors.worker.eagle3 import Eagle3Proposer
from vllm_actors.actors.worker.engine import Proposer, Runner
from vllm_actors.actors.worker.ngram_drafts import NgramProposer
from vllm_actors.actors.worker.ranks import Ranks
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.kernels.attention import attention_wave_tokens, describe_attention
from vllm_actors.models.kv_parallel import KvParallel
from vllm_actors.models.parallel import TensorParallel
from vllm_actors.models.pipeline import PipelineStage
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runner.gpu_events import step_timer
from vllm_actors.runner.grammar_tokenizer import worker_grammars
from vllm_actors.runner.kv_rejoin import rejoiner_for
from vllm_actors.runner.sampler import Sampler
from vllm_actors.runner.settings import defer_steps, spec_overlap, tp_graph_draws


class ModelShape(Protocol):
    """What the report reads of the model's configuration (``models.config.ModelConfig``)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def derived_max_model_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...


class LoadedRunner(Runner, Protocol):
    """A runner with its model loaded (``model_runner.ModelRunner``, or a test's fake)."""

    @property
    def model_config(self) -> ModelShape: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...


def proposer_for(drafter: Any, ranks: Ranks) -> Proposer | None:
    """The worker's proposer over the runner's drafter (an EAGLE-3 head's runner, or a draft model's,
    whose drafts are rank 0's on every tensor-parallel rank)."""
    if drafter is None:
        return None
    from vllm_actors.runner.eagle3 import Eagle3Runner

    return Eagle3Proposer(drafter) if isinstance(drafter, Eagle3Runner) else DraftProposer(drafter, ranks)


def ngram_proposer(config: EngineConfig) -> Proposer | None:
    """N-gram drafts in the worker (the scheduler plans them as placeholders with two steps in flight)."""
    spec = config.speculative_config
    if spec is None or spec.method != "ngram":
        return None
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)


def build_worker(config: EngineConfig, tp: TensorParallel | None = None, incarnation: int = 0,
                 runner: LoadedRunner | None = None, stage: PipelineStage | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 kvp: KvParallel | None = None, rendezvous: str = "") -> tuple[Worker, dict[str, Any]]:
    """The worker of ``config`` and its readiness report. ``tp``: this worker's rank of a
    tensor-parallel group, joined already; ``incarnation``: 0 for a first start (a restarted rank of
    a group drops plans until the reset plan); ``runner``: injected (tests), else a ``ModelRunner``
    loads ``config.model``; ``stage``: its pipeline stage (none: the whole model); ``kvp``: its
    KV-parallel rank (global rank 0 samples and broadcasts, in graphs too); ``rendezvous``: where its
    world was joined (a KV-parallel rank without TP or PP may then rejoin a new one alone)."""
    stage = stage or PipelineStage()
    kvp = kvp or KvParallel()
    if runner is None:
        from vllm_actors.runner.model_runner import ModelRunner

        runner = ModelRunner(config, tp, stage, kvp)
    shape = runner.model_config
    ranks: Ranks = kvp.world_ranks() if kvp.enabled else runner.tp
    grammars = worker_grammars(config.tokenizer or config.model, shape.vocab_size, shape.eos_token_ids)
    # The last stage launches a step before reading the previous one back, as without a pipeline; the
    # others read nothing back.
    defer = defer_steps() and stage.is_last
    worker = Worker(
        runner, Sampler(runner.device, config.seed), clock=clock, defer=defer,
        tp_graph_draws=tp_graph_draws() and not kvp.enabled,  # KVP: rank 0 draws, broadcasts
        grammars=grammars,
        await_reset=(ranks.enabled or stage.enabled) and incarnation > 0,
        host_tier=getattr(runner, "host_tier", None), stage=stage, ranks=ranks,
        drafter=proposer_for(getattr(runner, "drafter", None), ranks) or ngram_proposer(config),
        rejoiner=rejoiner_for(runner, rendezvous, runner.tp.size, stage.enabled),
        timer=step_timer(runner.device) if ranks.rank == 0 else None,  # rank 0 reports
        spec_overlap=spec_overlap(),
    )
    if stage.enabled:  # a stage's GPU time leaves out its waits for its input and for its last send
        stage.received.append(worker.timer.work_started)
        stage.sending.append(worker.timer.work_done)
    info = {
        "num_blocks": runner.num_blocks,
        "num_host_blocks": getattr(runner, "num_host_blocks", 0),
        "derived_max_model_len": shape.derived_max_model_len,
        "vocab_size": shape.vocab_size,
        "eos_token_ids": list(shape.eos_token_ids),
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "rank": runner.tp.rank,
        "tensor_parallel_size": runner.tp.size,
        "attention": describe_attention(getattr(getattr(runner, "model", None), "attn_backend", None)),
        "attention_wave_tokens": wave_tokens(runner),
        "pipeline_stage": stage.stage,
        "pipeline_parallel_size": stage.size,
        "kv_parallel_rank": kvp.rank,
        "kv_parallel_size": kvp.size,
        "kv_rejoin": worker.rejoiner is not None,  # a rank of it may restart alone (the supervisor reads it)
    }
    return worker, info


def wave_tokens(runner: Any) -> int:
    """The runner's ``attention_wave_tokens`` (0 without flash-attn 4 or off the GPU): the scheduler
    sizes pipelined chunks in whole waves of it."""
    model = getattr(runner, "model", None)
    config = getattr(runner, "local_config", None)
    device = getattr(runner, "device", None)
    if config is None or not isinstance(device, torch.device):
        return 0
    return attention_wave_tokens(getattr(model, "attn_backend", None), device, int(config.num_attention_heads),
                                 int(config.head_dim))
