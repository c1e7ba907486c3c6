"""Prompt logprobs from an in-process engine: what GPU tests compare between two attention paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def prompt_logprobs(model: Path, prompts: list[list[int]], dtype: str = "bfloat16", **engine: Any) -> torch.Tensor:
    """The logprob of every prompt token after the first, prompt by prompt, from an in-process engine (bf16
    unless ``dtype``) prefilling in chunks of 128 tokens (``engine``: further engine arguments)."""
    from vllm_actors import LLM, SamplingParams

    with LLM(str(model), executor="inprocess", dtype=dtype, max_num_batched_tokens=128,
             num_gpu_blocks_override=256, **engine) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    values = []
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.prompt_logprobs is not None
        values += [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
    return torch.tensor(values)
