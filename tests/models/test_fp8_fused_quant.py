"""VLLM_ACTORS_FP8_FUSED_QUANT in a tiny block-wise FP8 Qwen3 (the interpreter's Triton FP8 GEMMs):
the norms and SiLU(gate) * up quantize the FP8 projections' inputs themselves above the GEMV's rows,
and the logits and greedy tokens are exactly those of the unfused path; a one-row step (the
weight-only GEMV) keeps the unfused path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.fp8_checkpoints import quantize_checkpoint
from tests.support.tiny_models import PagedRunner
from vllm_actors.kernels import fp8_quant_fused
from vllm_actors.models import fp8
from vllm_actors.models.loader import load_model

pytest.importorskip("triton")

PROMPTS = {0: list(range(3, 11)), 1: list(range(40, 45))}  # a 13-row prefill, then a 2-row decode step


def _run(model: Any) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits of the batched prefill and a greedy two-sequence decode step, then a one-row step."""
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    out = runner.step(PROMPTS)
    logits, tokens = [out[0], out[1]], [[], []]
    for _ in range(1):
        for seq in (0, 1):
            tokens[seq].append(int(out[seq][-1].argmax()))
        out = runner.step({seq: [tokens[seq][-1]] for seq in (0, 1)})
        logits += [out[0], out[1]]
    logits.append(runner.step({0: [tokens[0][-1]]})[0])
    return torch.cat(logits), tokens


def test_fused_quant_gives_the_unfused_logits(tiny_qwen3: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = quantize_checkpoint(tiny_qwen3, tmp_path / "block", "block")
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM", "triton")  # FP8 projections on CPU tensors (the interpreter)
    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")  # the unfused norms and SiLU: their Triton kernels
    model, _ = load_model(str(path), torch.float32, torch.device("cpu"))
    assert any(isinstance(module, fp8.Fp8Linear) for module in model.modules())
    calls: list[tuple[str, int]] = []

    def counted(name: str) -> Any:
        original = getattr(fp8_quant_fused, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, args[0].shape[0]))
            return original(*args, **kwargs)

        return wrapper

    for name in ("rms_norm_quant", "silu_mul_quant"):
        monkeypatch.setattr(fp8_quant_fused, name, counted(name))
    monkeypatch.setenv("VLLM_ACTORS_FP8_FUSED_QUANT", "0")
    want_logits, want_tokens = _run(model)
    assert calls == []
    monkeypatch.setenv("VLLM_ACTORS_FP8_FUSED_QUANT", "1")
    got_logits, got_tokens = _run(model)
    assert torch.equal(got_logits, want_logits) and got_tokens == want_tokens
    # in each of the 3 layers two norms (qkv, gate_up) and SiLU (not layer 0's: its down_proj is left
    # unquantized), at 13 rows then 2; never at the one-row step
    assert sorted(set(calls)) == [("rms_norm_quant", 2), ("rms_norm_quant", 13), ("silu_mul_quant", 2),
                                  ("silu_mul_quant", 13)]
    assert len(calls) == 2 * 8


def test_setting_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_actors.envs import envs

    for text, mode in (("0", "off"), ("1", "eager"), ("on", "eager"), ("graphs", "graphs")):
        monkeypatch.setenv("VLLM_ACTORS_FP8_FUSED_QUANT", text)
        assert envs.VLLM_ACTORS_FP8_FUSED_QUANT == mode
    monkeypatch.setenv("VLLM_ACTORS_FP8_FUSED_QUANT", "sometimes")
    with pytest.raises(ValueError, match="must be 0, 1 or graphs"):
        _ = envs.VLLM_ACTORS_FP8_FUSED_QUANT
