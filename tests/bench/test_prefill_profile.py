"""The decode profile of ``benchmarks/prefill_profile.py``: it profiles exactly the steps it asks for, after
the prompt and the warm-up tokens, and leaves the engine idle (the CPU stands in for the GPU)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.lib.prefill_profile import max_model_len, profile_decode

from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig


def test_decode_profile_counts_its_steps(tiny_qwen3: Path) -> None:
    """At the limit the profile gives its engine: more profiled steps than the old fixed 64 tokens of room."""
    context, tokens = 100, 56
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", skip_tokenizer_init=True,
                          max_model_len=max_model_len(context, tokens), enable_prefix_caching=False)
    engine = InProcessEngine(config, tokenizer=None)
    report = profile_decode(engine, context=context, tokens=tokens, top=3)
    assert report["steps"] >= tokens and report["context"] == context
    assert report["wall_ms_per_token"] > 0 and len(report["top_kernels"]) <= 3
    assert not engine.has_unfinished
