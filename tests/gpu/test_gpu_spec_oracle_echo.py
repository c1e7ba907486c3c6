"""On a GPU: the oracle benchmark's echo dummy weights (``VLLM_ACTORS_DUMMY_WEIGHTS=echo``) keep the
greedy output of no speculation under verification steps in bfloat16 (CUDA graphs, the fused
sampler, several rows a step), so the oracle at acceptance 1 keeps every draft and at 0.6 measures
its set acceptance; a batch of several requests too (the verification shapes of concurrent rows).

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh (or pytest -m gpu).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmarks.lib import spec_oracle

from tests.engine.test_spec_oracle_echo import PROMPTS, TINY_8B, K
from vllm_actors import LLM, SamplingParams
from vllm_actors.bench.throughput_workload import write_model_dir
from vllm_actors.protocol.speculative import parse_speculative_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = {"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 512, "skip_tokenizer_init": True,
        "gpu_memory_utilization": 0.3}
MAX_TOKENS = 96


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)  # one batch
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_echo_weights_keep_the_oracle_exact_on_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_DUMMY_WEIGHTS", "echo")
    monkeypatch.setenv("VLLM_ACTORS_ALLOW_ORACLE_DRAFTER", "1")
    model = str(write_model_dir(tmp_path / "tiny", {**TINY_8B, "hidden_size": 512, "intermediate_size": 1024,
                                                    "num_attention_heads": 8, "head_dim": 64}))
    with LLM(model, **ARGS) as llm:
        recorded = _generate(llm)
    assert recorded == [[p[-1]] * MAX_TOKENS for p in PROMPTS]
    pairs = [[p, o] for p, o in zip(PROMPTS, recorded, strict=True)]
    for acceptance, tolerance in ((1.0, 0.0), (0.6, 0.08)):
        spec = parse_speculative_config({"method": "oracle", "num_speculative_tokens": K, "oracle_seed": 3,
                                         "oracle_tokens": pairs, "oracle_acceptance": acceptance}, adaptive=False)
        with LLM(model, speculative_config=spec, **ARGS) as llm:
            assert _generate(llm) == recorded
            counts = spec_oracle.counts(llm)
        zero = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * K}
        found = spec_oracle.summarize(zero, counts, [(MAX_TOKENS, 1.0)] * len(PROMPTS), K, None)
        assert abs(found["measured_acceptance"] - acceptance) <= tolerance + 0.02, found  # max_tokens cuts
