"""Engine configuration with vLLM's argument names. No torch here: every actor imports it."""

from __future__ import annotations

import math

import msgspec

from vllm_actors.protocol.kv_loans import kv_borrowing_error
from vllm_actors.protocol.kv_parallel import kv_parallel_error
from vllm_actors.protocol.long_prefill import long_prefill_error, resolve_threshold
from vllm_actors.protocol.speculative import (
    SpeculativeConfig,
    parse_speculative_config,
)

# On CPU the KV pool is sized from a fixed memory budget (vLLM reads VLLM_CPU_KVCACHE_SPACE, in GiB,
# default 4). Ours defaults to 1 GiB, overridable through the cpu_kv_cache_gib argument (which
# make_engine_config fills from VLLM_ACTORS_CPU_KVCACHE_SPACE when it is not given).
DEFAULT_CPU_KV_CACHE_GIB = 1.0
SUPPORTED_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
# The KV cache's storage type (vLLM's names): "auto" is the model's dtype; "fp8" and "fp8_e4m3" are
# float8_e4m3fn with a scale per layer (k_scale, v_scale), "fp8_e5m2" is float8_e5m2 without scales.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority", "edf", "lrs")
# How a replica set's controller spreads requests over its replicas (actors/controller/routing.py).
ROUTING_POLICIES = ("round_robin", "least_loaded", "pull", "cache_aware")
# Who places a replica set's replicas (vLLM's --distributed-executor-backend): "mp", this host's
# supervisor starts every process; "ray", Ray places each replica's process group on a node of its
# cluster (runtime/ray_replicas.py) and the controller routes to them over TCP + CURVE.
EXECUTOR_BACKENDS = ("mp", "ray")


# The smallest chunk sequence pipeline parallelism plans for (actors/scheduler/spp_chunks.py): GEMMs lose
# efficiency below 1-2k rows. More chunks shrink the pipeline's bubble: at 32k on the H200 a floor of 1,024
# (those chunks attended by flash-attn 4 over their long context) took PP=2 720 -> 691 ms and PP=4 426 -> 389.
SPP_MIN_CHUNK_TOKENS = 1024


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str  # a Hugging Face directory or a .gguf file
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16  # make_engine_config gives the device's when none is given (device_probe.py)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # fp8 KV cache: each layer's k_scale and v_scale from the first step's amax (vLLM's
    # calculate_kv_scales) instead of the checkpoint's scales or 1.0
    calculate_kv_scales: bool = False
    cpu_kv_cache_gib: float | None = None
    # Host memory (GiB, vLLM's spelling) for a second tier of the prefix cache: blocks evicted from
    # the KV pool are copied there (pinned memory on a GPU) and copied back on a later hit. 0: off.
    kv_cache_offload_gb: float = 0.0
    seed: int = 0
    enforce_eager: bool = False
    skip_tokenizer_init: bool = False
    # Workers worker-0..N-1 as the ranks of one tensor-parallel group (the process executor only).
    tensor_parallel_size: int = 1
    # Stages of a pipeline (vLLM's pipeline_parallel_size): each a contiguous range of the layers,
    # held by tensor_parallel_size workers; pipeline_parallel_size x tensor_parallel_size workers in all.
    pipeline_parallel_size: int = 1
    # KV parallelism (Vajra's kv_parallel_size): each request's KV blocks spread over this many
    # ranks, each holding the whole model (or a TP group of it), attention merged by log-sum-exp
    # (kernels/kv_parallel.py); kv_parallel_size x tensor_parallel_size workers in all.
    kv_parallel_size: int = 1
    device: str = "auto"  # "auto", "cpu" or "cuda[:N]"
    load_format: str = "auto"  # "auto" (the checkpoint's weights) or "dummy" (random, real shapes)
    async_scheduling: bool = True  # plan step N+1 while step N runs
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes already computed
    # The waiting queue's order: "fcfs" (arrival) or "lpm" (longest cached prefix first, SGLang's
    # name; falls back to arrival order when more than policies/lpm.py's LPM_MAX_WAITING requests wait),
    # "priority" (vLLM's: (priority, arrival), preempting the lowest-priority running request) or
    # "edf" (earliest absolute deadline first, requests without one after) or "lrs" (least remaining
    # slack: deadline minus the predicted remaining work; actors/scheduler/policies/).
    scheduling_policy: str = "fcfs"
    # Admission control: refuse at arrival a request whose deadline the step cost model says cannot
    # be met (the server answers 503 with the reason) instead of serving it late.
    reject_unmeetable: bool = False
    # Prefills sized for their neighbours (protocol/long_prefill.py; vLLM's names for the first three).
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    itl_target_ms: float | None = None
    # Sequence pipeline parallelism: the smallest prefill chunk the equal-time plan makes at the end of
    # a long prompt (None: SPP_MIN_CHUNK_TOKENS; VLLM_ACTORS_SPP_MIN_CHUNK_TOKENS where not given).
    spp_min_chunk_tokens: int | None = None
    # Replicas (vLLM's data parallelism): data_parallel_size full groups (scheduler, KV-cache
    # manager, workers) under one controller that routes each request by routing_policy.
    data_parallel_size: int = 1
    routing_policy: str = "round_robin"
    distributed_executor_backend: str = "mp"
    # A request too long for one replica's pool borrows KV blocks of the other replicas of the set
    # (protocol/kv_loans.py; the CPU only for now, one worker per replica).
    kv_borrowing: bool = False
    # Steps async scheduling plans ahead of the results (1 without async_scheduling).
    steps_in_flight: int = 2
    # Engine actors publish no work events: measures what the events cost (benchmarks).
    disable_events: bool = False
    # Check the scheduler's and KV-cache manager's invariants after every message (tests; slow).
    check_invariants: bool = False
    # LoRA adapters (vLLM's): up to max_loras adapters in one batch (their slots on the device),
    # max_cpu_loras (None: max_loras) kept loaded on the host, ranks up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, ...};
    # protocol/speculative.py); a dict given here is parsed and checked by __post_init__.
    speculative_config: SpeculativeConfig | None = None
    # (make_engine_config also takes the last three from their deprecated environment aliases,
    # VLLM_ACTORS_STEPS_IN_FLIGHT, VLLM_ACTORS_DISABLE_EVENTS and VLLM_ACTORS_CHECK_INVARIANTS.)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a Hugging Face directory or a .gguf file")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "pipeline_parallel_size",
                     "kv_parallel_size", "data_parallel_size", "steps_in_flight"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override", "spp_min_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib is not None and not self.cpu_kv_cache_gib > 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if (isinstance(self.kv_cache_offload_gb, bool) or not isinstance(self.kv_cache_offload_gb, (int, float))
                or not 0 <= self.kv_cache_offload_gb < math.inf):
            raise ValueError(f"kv_cache_offload_gb must be a number of GiB >= 0 (0: no host tier), "
                             f"got {self.kv_cache_offload_gb!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        error = long_prefill_error(self)
        if error is not None:
            raise ValueError(error)
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.data_parallel_size == 1:
            raise ValueError("distributed_executor_backend 'ray' places the replicas of a replica set: "
                             "it needs data_parallel_size > 1 (one replica runs on this host with 'mp')")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.speculative_config is not None:
            self.speculative_config = _runnable_speculation(self.speculative_config)
            if self.pipeline_parallel_size > 1:
                raise ValueError("speculative_config does not compose with pipeline_parallel_size > 1 yet")
            method = self.speculative_config.method
            if method == "eagle3" and self.tensor_parallel_size > 1:
                raise ValueError(f"speculative_config: method {method!r} runs with tensor_parallel_size 1 only "
                                 "for now (the head would read every rank's hidden states)")
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise ValueError("enable_lora does not compose with pipeline_parallel_size > 1 yet: "
                             "serve the adapters with tensor_parallel_size instead")
        error = kv_parallel_error(self) or kv_borrowing_error(self)
        if error is not None:
            raise ValueError(error)

    @property
    def world_size(self) -> int:
        """The workers of one replica: every rank of every pipeline stage (or KV-parallel rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.kv_parallel_size

    @property
    def answering_rank(self) -> int:
        """The worker that samples and answers the scheduler: the last stage's first rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def kv_cache_offload_bytes(self) -> int:
        return int(self.kv_cache_offload_gb * (1 << 30))

    def resolved_cpu_kv_cache_bytes(self) -> int:
        gib = DEFAULT_CPU_KV_CACHE_GIB if self.cpu_kv_cache_gib is None else self.cpu_kv_cache_gib
        return int(gib * (1 << 30))


class SchedulerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """What the scheduler needs, once the model and the KV pool are known."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    block_size: int
    num_blocks: int
    max_steps_in_flight: int = 2  # 2: plan step N+1 while step N runs (async scheduling)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    reject_unmeetable: bool = False
    # The model's vocabulary (what the worker reported): token ids arriving on the scheduler's
    # socket must lie below it. None: not known (tests); ids are then only checked against int32.
    vocab_size: int | None = None
    num_host_blocks: int = 0  # the host KV tier's size in blocks (0: none)
    # Prompts of at least this many tokens have their blocks copied to the host tier as they are
    # computed (a restarted worker resumes them from there); 0: none.
    host_write_through_tokens: int = 0
    # Prefill sizing (protocol/long_prefill.py): the threshold resolved; the ITL target in seconds.
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    itl_target: float | None = None
    # Pipeline stages: above 1, a request's next step is planned only once its sampled token is
    # back (the stages before the last learn it from the plan), and max_steps_in_flight fills them.
    pipeline_parallel_size: int = 1
    spp_min_chunk_tokens: int = SPP_MIN_CHUNK_TOKENS  # the equal-time plan's smallest chunk
    # a pipelined chunk's tokens in whole waves of flash-attn 4's CTAs (the workers' report; 0: none)
    attention_wave_tokens: int = 0
    max_loras: int = 0  # LoRA adapters a step may use (the worker's device slots); 0: LoRA off
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)


def _runnable_speculation(given: object) -> SpeculativeConfig:
    """The speculative config parsed and checked (``make_engine_config`` checks a draft
    checkpoint's path before)."""
    return parse_speculative_config(given)  # type: ignore[arg-type]  # checked there: a dict or the Struct


def resolve_scheduler_config(
    config: EngineConfig, model_max_len: int, num_blocks: int, vocab_size: int | None = None, *,
    allow_long_max_model_len: bool = False, num_host_blocks: int = 0, host_write_through_tokens: int = 0,
    attention_wave_tokens: int = 0,
) -> SchedulerConfig:
    """Fill in the defaults that depend on the model and on the KV pool the worker made.

    ``model_max_len``: the model's derived limit (``ModelConfig.derived_max_model_len``); a longer
    ``max_model_len`` raises unless ``allow_long_max_model_len`` (VLLM_ACTORS_ALLOW_LONG_MAX_MODEL_LEN)."""
    max_model_len = config.max_model_len or model_max_len
    if max_model_len > model_max_len and not allow_long_max_model_len:
        raise ValueError(
            f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
            f"({model_max_len}: max_position_embeddings in the model's config.json, times the rope scaling "
            "factor for the rope types that stretch it). To allow a longer one, set "
            "VLLM_ACTORS_ALLOW_LONG_MAX_MODEL_LEN=1: positions beyond the model's limit give wrong outputs."
        )
    if config.max_num_batched_tokens is not None:
        budget = config.max_num_batched_tokens
    elif config.enable_chunked_prefill:
        budget = 8192  # vLLM's server default on 80 GB GPUs (its LLM class takes 16384 there)
    else:
        budget = max(max_model_len, 8192)
    if not config.enable_chunked_prefill and budget < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) is smaller than max_model_len ({max_model_len}) "
            "while chunked prefill is disabled: long prompts could never be scheduled"
        )
    threshold = resolve_threshold(config, max_model_len)  # against the limit asked for, as vLLM
    blocks_per_seq = math.ceil(max_model_len / config.block_size)
    if num_blocks < 1:
        raise ValueError(f"the KV pool has no blocks (num_blocks={num_blocks}); give it more memory")
    if num_blocks < blocks_per_seq and not config.kv_borrowing:  # borrowing: the model's limit
        # Still usable, but a single request can never reach max_model_len: cap it.
        max_model_len = num_blocks * config.block_size
    return SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=config.enable_chunked_prefill,
        block_size=config.block_size,
        num_blocks=num_blocks,
        max_steps_in_flight=steps_in_flight(config),
        enable_prefix_caching=config.enable_prefix_caching,
        scheduling_policy=config.scheduling_policy,
        reject_unmeetable=config.reject_unmeetable,
        vocab_size=vocab_size,
        num_host_blocks=num_host_blocks,
        host_write_through_tokens=host_write_through_tokens if num_host_blocks else 0,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=config.max_num_partial_prefills,
        max_long_partial_prefills=config.max_long_partial_prefills,
        itl_target=None if config.itl_target_ms is None else config.itl_target_ms / 1000,
        pipeline_parallel_size=config.pipeline_parallel_size,
        spp_min_chunk_tokens=config.spp_min_chunk_tokens or SPP_MIN_CHUNK_TOKENS,
        attention_wave_tokens=attention_wave_tokens,
        max_loras=config.max_loras if config.enable_lora else 0,
        speculative=config.speculative_config,
    )


def steps_in_flight(config: EngineConfig) -> int:
    """Plans sent ahead of their results: ``steps_in_flight`` under async scheduling (else 1); with
    P pipeline stages at least P micro-batches, one more under async scheduling (it covers the
    round trip of a result to the scheduler and of the next plan to the first stage)."""
    depth = config.steps_in_flight if config.async_scheduling else 1
    pp = config.pipeline_parallel_size
    return depth if pp == 1 else max(depth, pp + int(config.async_scheduling))
