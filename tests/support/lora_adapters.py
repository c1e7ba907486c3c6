"""PEFT LoRA adapters for the tiny test checkpoints, made with peft on the spot (random A and a
random non-zero B, so each adapter changes the outputs), and transformers + PEFT as the reference."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_TARGETS = ATTENTION + ("gate_proj", "up_proj", "down_proj")


def build_adapter(base: Path, out: Path, targets: tuple[str, ...] = ALL_TARGETS, rank: int = 8, alpha: int = 16,
                  seed: int = 1, use_rslora: bool = False, scale: float = 0.3) -> Path:
    """Save a PEFT LoRA adapter of the checkpoint at ``base`` to ``out`` (A and B drawn from ``seed``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters(), key=lambda item: item[0]):
            if "lora_A" in name or "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(out)
    return out


@functools.lru_cache(maxsize=4)
def reference_model(base: Path, adapter: Path | None) -> Any:
    """transformers' float32 model of ``base`` (with PEFT's ``adapter``), loaded once per pair."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def reference_greedy(base: Path, adapter: Path | None, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers (+ PEFT with ``adapter``) in float32, greedy: the generated token ids."""
    import torch

    model = reference_model(base, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def reference_logits(base: Path, adapter: Path | None, token_ids: list[int]) -> Any:
    """transformers (+ PEFT) float32 logits of every position of ``token_ids``."""
    import torch

    with torch.no_grad():
        return reference_model(base, adapter)(torch.tensor([token_ids])).logits[0]
