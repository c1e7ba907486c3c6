"""The checks of ``kv_parallel_size`` (KV parallelism) that need no model. No torch here."""

from __future__ import annotations

from typing import Any


def kv_parallel_error(config: Any) -> str | None:
    """What is wrong with the KV-parallel arguments of an ``EngineConfig``, or None: the
    combinations not supported yet are refused by name."""
    size = config.kv_parallel_size
    if size == 1:
        return None
    if config.pipeline_parallel_size > 1:
        return (f"kv_parallel_size {size} with pipeline_parallel_size {config.pipeline_parallel_size} is not "
                "supported yet: use kv_parallel_size with tensor_parallel_size only")
    if config.kv_cache_offload_gb:
        return (f"kv_parallel_size {size} with kv_cache_offload_gb {config.kv_cache_offload_gb} is not "
                "supported yet: the host KV tier copies whole blocks of one rank's pool (set it to 0)")
    if config.enable_lora or config.speculative_config is not None:
        return (f"kv_parallel_size {size} with enable_lora or speculative_config is not supported yet: "
                "every rank would need the adapters' slots or the drafts' rollback")
    if config.distributed_executor_backend != "mp":
        return (f"kv_parallel_size {size} with distributed_executor_backend "
                f"{config.distributed_executor_backend!r} is not supported yet: use 'mp'")
    override = config.num_gpu_blocks_override
    if override is not None and override % size:
        return (f"num_gpu_blocks_override ({override}) counts the blocks of every KV-parallel rank together: "
                f"it must be a multiple of kv_parallel_size ({size})")
    return None
