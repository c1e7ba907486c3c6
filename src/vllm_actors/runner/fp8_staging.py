"""The runner's side of the staged fp8 prefill (``kernels/fp8_prefill_stage.py``): its buffers made once,
before the KV pool is sized (so ``gpu_memory_utilization`` counts them), handed to the model's
attention backend, and the steps that take it kept out of the padded CUDA graphs (they run eagerly), as are
the steps flash-attn 4 takes only by their context (``flash_attn_outruns_graph``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch

from vllm_actors.envs import envs
from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill, layout_problem
from vllm_actors.kernels.prefill_choice import prefill_kernel

if TYPE_CHECKING:
    from vllm_actors.kernels.fp8_prefill_stage import Fp8PrefillStaging

log = structlog.get_logger(__name__)


def fp8_staging_for(model: Any, kv_cache_dtype: torch.dtype, config: Any, dtype: torch.dtype,
                    device: torch.device, max_num_tokens: int) -> Fp8PrefillStaging | None:
    """The staged path of a runner (``config``: its local ``ModelConfig``, this rank's heads), handed to
    the model's attention backend; None, nothing allocated, where it does not apply: no fp8 cache, no
    flash-attn path (not Hopper, not installed, ``triton``), a layout flash-attn cannot take, chunks
    never as long as flash-attn's threshold, or VLLM_ACTORS_FP8_PREFILL_STAGING=0."""
    backend = getattr(model, "attn_backend", None)
    prefill = getattr(backend, "prefill", None)
    if not isinstance(prefill, FlashAttnPrefill) or not hasattr(backend, "staging") \
            or not kv_quant.is_fp8(kv_cache_dtype) or not envs.VLLM_ACTORS_FP8_PREFILL_STAGING:
        return None
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.empty((0, heads, head_dim), dtype=dtype, device="meta")
    kv = torch.empty((0, 1, kv_heads, head_dim), dtype=dtype, device="meta")
    problem = layout_problem(q, kv, kv)
    if problem is not None or prefill_kernel(prefill.choice, True, max_num_tokens, head_dim) != "flash_attn":
        log.debug("fp8_prefill_staging_off", reason=problem or "chunks shorter than flash-attn's threshold")
        return None
    from vllm_actors.kernels.fp8_prefill_stage import Fp8PrefillStaging  # Triton: imported where it runs

    staging = Fp8PrefillStaging(prefill, heads, kv_heads, head_dim, dtype, device, max_num_tokens)
    attach_fp8_staging(model, staging)
    log.info("fp8_prefill_staging_on", stage=staging.stage, mib=staging.nbytes >> 20)
    return staging


def attach_fp8_staging(model: Any, staging: Fp8PrefillStaging | None) -> None:
    """Hand ``staging`` to the model's attention backend (again after the model was reloaded)."""
    backend: Any = getattr(model, "attn_backend", None)
    prefill = getattr(backend, "prefill", None)
    if staging is not None and isinstance(prefill, FlashAttnPrefill) and hasattr(backend, "staging"):
        backend.staging = staging
        staging.prefill = prefill


def staged_step(model: Any, query_lens: list[int]) -> bool:
    """Whether a step of these query lengths takes the staged path (the runner then runs it eagerly)."""
    staging = getattr(getattr(model, "attn_backend", None), "staging", None)
    return staging is not None and bool(query_lens) and staging.takes_step(len(query_lens), max(query_lens))


def flash_attn_outruns_graph(model: Any, query_lens: list[int], seq_lens: list[int], block_size: int, config: Any,
                             padded_tokens: int, device: torch.device) -> bool:
    """Whether the step takes flash-attn 4 where the padded graph of its size would not (a chunk over a long
    context, split over its keys or not): the runner then runs it eagerly (``outruns_padded_graph``)."""
    prefill = getattr(getattr(model, "attn_backend", None), "prefill", None)
    return isinstance(prefill, FlashAttnPrefill) and prefill.outruns_padded_graph(
        query_lens, seq_lens, block_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        padded_tokens, device)
