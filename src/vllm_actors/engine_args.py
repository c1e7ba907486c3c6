"""Engine arguments in vLLM's spelling: the command line's flags and the keyword arguments of ``LLM``,
``AsyncEngineClient`` and ``serve``, turned into one ``EngineConfig``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.device_probe import default_block_size, offline_batched_tokens
from vllm_actors.envs import envs
from vllm_actors.protocol.config import EXECUTOR_BACKENDS, KV_CACHE_DTYPES, SCHEDULING_POLICIES, EngineConfig
from vllm_actors.protocol.speculative import ORACLE, SpeculativeConfig, parse_speculative_config

log = structlog.get_logger(__name__)

_ENGINE_ARGS = set(EngineConfig.__struct_fields__) - {"model"}
# Engine arguments taken from the environment where they are not given: the deprecated aliases of
# three former settings, and the CPU KV pool's size (vLLM's VLLM_CPU_KVCACHE_SPACE, in our name).
DEPRECATED_ALIASES = {
    "steps_in_flight": "VLLM_ACTORS_STEPS_IN_FLIGHT",
    "disable_events": "VLLM_ACTORS_DISABLE_EVENTS",
    "check_invariants": "VLLM_ACTORS_CHECK_INVARIANTS",
}
ENVIRONMENT_DEFAULTS = {**DEPRECATED_ALIASES, "cpu_kv_cache_gib": "VLLM_ACTORS_CPU_KVCACHE_SPACE",
                        "spp_min_chunk_tokens": "VLLM_ACTORS_SPP_MIN_CHUNK_TOKENS"}


def make_engine_config(model: str | None, engine_args: Mapping[str, Any], *, offline: bool = False) -> EngineConfig:
    """The engine's config from vLLM-named arguments, with the device's defaults where none is given;
    ``offline``: for the LLM class, whose step budget on large GPUs is vLLM's LLM class's (device_probe.py)."""
    unknown = sorted(set(engine_args) - _ENGINE_ARGS)
    if unknown:
        raise TypeError(f"unknown engine arguments: {', '.join(unknown)}; known: {', '.join(sorted(_ENGINE_ARGS))}")
    if model is None:
        from vllm_actors.default_model import default_model_path

        model = default_model_path()
    args = {**environment_defaults(engine_args), **engine_args}
    if args.get("block_size") is None:  # not given: the device's (device_probe.py)
        args["block_size"] = default_block_size(str(args.get("dtype", "auto")), str(args.get("device", "auto")))
    if offline and args.get("max_num_batched_tokens") is None and args.get("enable_chunked_prefill", True):
        args["max_num_batched_tokens"] = offline_batched_tokens(str(args.get("device", "auto")))
    if args.get("speculative_config") is not None:
        args["speculative_config"] = speculative_config(args["speculative_config"])
    return EngineConfig(model=model, **args)


def speculative_config(given: Any) -> SpeculativeConfig:
    """``speculative_config`` (a dict, or the JSON text of ``--speculative-config``) checked, with
    its draft checkpoint's path and the adaptive-drafts setting (``VLLM_ACTORS_SPEC_ADAPTIVE``)."""
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config must be a JSON object: {error}") from None
    config = parse_speculative_config(given, adaptive=envs.VLLM_ACTORS_SPEC_ADAPTIVE)
    if config.method == ORACLE and not envs.VLLM_ACTORS_ALLOW_ORACLE_DRAFTER:
        raise ValueError("speculative_config: method 'oracle' is for benchmarks only: set "
                         "VLLM_ACTORS_ALLOW_ORACLE_DRAFTER=1 to use it")
    if config.model is not None and not Path(config.model).exists():
        raise ValueError(f"speculative_config: model {config.model!r} does not exist (a directory or file path)")
    return config


def environment_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """The engine arguments not in ``given`` whose environment variable is set, with its value."""
    found = {field: getattr(envs, name) for field, name in ENVIRONMENT_DEFAULTS.items()
             if field not in given and envs.is_set(name)}
    for field in found.keys() & DEPRECATED_ALIASES.keys():
        log.info("deprecated setting", variable=DEPRECATED_ALIASES[field], engine_argument=field)
    return found



def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags in vLLM's spelling."""
    parser.add_argument(
        "--model", default=None,
        help="Hugging Face directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights in the checkpoint's shapes (only config.json is read)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "half", "float"])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="a prompt with more tokens left than this is long: a step gives it at most this many "
                             "(0: no threshold; 4%% of max_model_len when --max-num-partial-prefills > 1)")
    parser.add_argument("--max-num-partial-prefills", type=int, default=1,
                        help="above 1: the most prefills one step carries at once")
    parser.add_argument("--max-long-partial-prefills", type=int, default=1,
                        help="with --max-num-partial-prefills > 1: the most long ones among them (shorter prompts "
                             "pass long ones waiting)")
    parser.add_argument("--itl-target-ms", type=float, default=None,
                        help="the inter-token latency running decodes are held to: each step's prefill tokens are "
                             "sized by the step cost model to keep its predicted time within it (default: none)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens a KV block holds (a power of two; default: 128 on Hopper GPUs with flash-attn 4, "
                             "whose prefill loads such pages by TMA, else 16)")
    parser.add_argument("--num-gpu-blocks-override", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="the KV cache's storage: auto (the model's dtype), fp8 / fp8_e4m3 (float8 e4m3 with "
                             "per-layer scales: half the bytes of bf16, twice the tokens) or fp8_e5m2")
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="fp8 KV cache: take each layer's k/v scales from the first step's amax "
                             "(else the checkpoint's, else 1.0)")
    parser.add_argument("--kv-cache-offload-gb", type=float, default=0.0,
                        help="GiB of host memory for a second tier of the prefix cache: blocks evicted from the KV "
                             "pool are copied there and back on a later hit instead of recomputed (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="pipeline stages, each a contiguous range of the layers on its own worker(s) "
                             "(VLLM_PP_LAYER_PARTITION sets the split); PP x TP workers in all")
    parser.add_argument("--kv-parallel-size", type=int, default=1,
                        help="KV parallelism: each request's KV blocks interleaved over this many ranks, each "
                             "holding the whole model (or a TP group of it); KVP x TP workers in all")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="replicas, each a full scheduler, KV-cache manager and workers, under one controller")
    parser.add_argument("--routing-policy", choices=["round_robin", "least_loaded", "pull", "cache_aware"],
                        default="round_robin", help="how the controller spreads requests over the replicas")
    parser.add_argument("--distributed-executor-backend", choices=list(EXECUTOR_BACKENDS), default="mp",
                        help="who places the replicas: mp (this host's supervisor) or ray (one process group per "
                             "replica on the nodes of a Ray cluster, over TCP with CURVE keys)")
    parser.add_argument("--kv-borrowing", action="store_true",
                        help="a request too long for one replica's KV pool borrows blocks of the other replicas "
                             "(with --data-parallel-size > 1; one worker per replica, on the CPU or one GPU each)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="do not reuse the KV blocks of prompt prefixes already computed")
    parser.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default="fcfs",
                        help="who runs first: arrival (fcfs), longest cached prefix (lpm), the request's priority "
                             "(priority: lower first, preempting higher values; vLLM's), earliest deadline (edf) or "
                             "least remaining slack by the step cost model (lrs)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (PEFT): --lora-modules, or a request's lora_request")
    parser.add_argument("--max-loras", type=int, default=1,
                        help="LoRA adapters one batch may use (their slots on the device)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank taken")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="LoRA adapters kept loaded in host memory (default: --max-loras)")
    parser.add_argument("--reject-unmeetable", action="store_true",
                        help="admission control: refuse at arrival (HTTP 503 with the reason) a request whose "
                             "deadline the step cost model says cannot be met")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding as JSON, vLLM\'s keys: \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "tokenizer", "load_format", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "enable_chunked_prefill", "long_prefill_token_threshold", "max_num_partial_prefills",
        "max_long_partial_prefills", "itl_target_ms", "block_size", "num_gpu_blocks_override", "gpu_memory_utilization",
        "kv_cache_dtype", "calculate_kv_scales", "kv_cache_offload_gb", "seed", "enforce_eager",
        "tensor_parallel_size", "pipeline_parallel_size", "kv_parallel_size", "device",
        "enable_prefix_caching", "scheduling_policy", "reject_unmeetable", "data_parallel_size", "routing_policy",
        "distributed_executor_backend", "kv_borrowing", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
        "speculative_config",
    )
    return {name: getattr(args, name) for name in names}
