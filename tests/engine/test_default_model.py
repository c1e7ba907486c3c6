"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy output identical to
transformers loading the same GGUF, given the same prompt token ids."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_actors import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colours."}],
    [{"role": "user", "content": "Write one sentence about the number 1234567."}],
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(default_gguf_path: str):
    with LLM(dtype="float32") as engine:
        yield engine


def test_default_model_is_the_embedded_gguf(llm: LLM, default_gguf_path: str) -> None:
    from vllm_actors.models.config import ModelConfig

    assert llm.config.model == default_gguf_path
    config = ModelConfig.from_path(llm.config.model)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)


def test_greedy_chat_matches_transformers_on_the_gguf(llm: LLM, hf_default_gguf_model: Any) -> None:
    outputs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    model = hf_default_gguf_model
    with torch.no_grad():
        for output in outputs:
            prompt = output.prompt_token_ids
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=model.generation_config.eos_token_id,
            )[0, len(prompt):].tolist()
            # Both stop at end-of-sequence and include it, or both stop at max_tokens.
            assert output.outputs[0].token_ids == generated
    assert "Paris" in outputs[0].outputs[0].text
