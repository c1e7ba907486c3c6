"""The draft model of speculative decoding (``method: draft_model``): a second model runner beside
the target's, in the same worker, on the same device (``ModelRunner.drafter``).

Its KV tensors have the target's block size and the same number of blocks, addressed by the same
block ids: a request's block table holds its draft KV too, so the KV-cache manager, the prefix
cache and the trims of rejected drafts need no change. Its weights are loaded before the target
sizes its pool (which then leaves them their memory and counts the draft's bytes in each block);
the draft's pool and its decode CUDA graphs (the autoregressive drafting steps are decode-shaped)
come once the target knows the number of blocks (``KvPoolSizing.take_pool``). A catch-up of a few
tokens a request runs in those graphs as decode rows (``verify_rows.py``); a longer one (a prompt)
runs eagerly (no padded graphs).

The draft must share the target's vocabulary and reach its ``max_model_len``; it runs unsharded
(vLLM's ``draft_tensor_parallel_size`` 1): under tensor parallelism every rank holds the whole draft
and its KV on its own GPU and drafts, and rank 0's drafts are the step's on every rank
(``DraftProposer``: one broadcast a drafting step).
"""

from __future__ import annotations

import msgspec

from vllm_actors.models.config import ModelConfig
from vllm_actors.protocol.config import EngineConfig


def check_draft(target: ModelConfig, draft: ModelConfig, max_model_len: int, path: str) -> None:
    """A ``ValueError`` where the draft cannot serve the target: another vocabulary, a shorter limit."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the draft model {path!r} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}: a draft model must share the target's "
                         "tokenizer and vocabulary")
    if draft.derived_max_model_len < max_model_len:
        raise ValueError(f"speculative_config: the draft model {path!r} reaches {draft.derived_max_model_len} "
                         f"tokens (its max_position_embeddings), below the engine's max_model_len "
                         f"{max_model_len}; pass max_model_len <= {draft.derived_max_model_len}")


def draft_config(config: EngineConfig, target: ModelConfig, max_model_len: int, device: str) -> EngineConfig | None:
    """The draft model's runner configuration (checked; a one-block pool until ``take_pool``, no
    graphs until then; on the target's ``device``, a tensor-parallel rank's GPU), or None when the
    engine does not speculate with a draft model."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    check_draft(target, ModelConfig.from_path(spec.model), max_model_len, spec.model)
    return msgspec.structs.replace(
        config, model=spec.model, tokenizer=None, max_model_len=max_model_len, num_gpu_blocks_override=1,
        enforce_eager=True, enable_lora=False, kv_cache_offload_gb=0.0, speculative_config=None,
        tensor_parallel_size=1, device=device)
