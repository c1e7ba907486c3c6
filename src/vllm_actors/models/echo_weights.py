"""Dummy weights whose greedy output does not depend on rounding (``VLLM_ACTORS_DUMMY_WEIGHTS=echo``,
benchmarks only): the random weights of ``load_format="dummy"`` with every residual contribution
scaled down (attention's ``o_proj``, the MLP's ``down_proj``, the experts' ``w2``) and the LM head
equal to the embedding. The last hidden state is then close to the current token's embedding, whose
logit leads every other by a wide margin (about ``0.02 * hidden_size`` against ``0.02 * sqrt(hidden_size)``
per rival at normal(0, 0.02) rows), so greedy decoding repeats the prompt's last token under any
kernel or batch shape. The shapes, kernels and bytes per step are those of the random weights.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_actors.kernels.fp8_gemm import FP8_DTYPE
from vllm_actors.models import fp8
from vllm_actors.models.llama import CausalLM
from vllm_actors.models.moe import SparseMoeBlock

RESIDUAL_SCALE = 1e-4  # a layer's contribution over an embedding's: ~1e-4 x (1.3-1.8) against 0.02 per entry
RESIDUAL_PROJECTIONS = ("o_proj", "down_proj")  # the projections that write into the residual stream


def make_echo(model: CausalLM) -> None:
    """Turn ``model``'s freshly drawn dummy weights into echo weights (see the module's docstring)."""
    if model.config.gemma_norms:
        raise ValueError("echo dummy weights need residual contributions that scale with their projections; "
                         "Gemma's norms after attention and MLP undo that (use the random dummy weights)")
    if not (model.stage.is_first and model.stage.is_last):
        raise ValueError("echo dummy weights set the LM head to the embedding: one stage must hold both "
                         "(pipeline_parallel_size 1)")
    with torch.no_grad():
        for layer in model.stage_layers():
            for name, module in layer.named_modules():
                if name.rsplit(".", 1)[-1] in RESIDUAL_PROJECTIONS:
                    assert isinstance(module, (nn.Linear, fp8.Fp8Linear)), name
                    _scale_projection(module)
                elif isinstance(module, SparseMoeBlock):  # its experts' down projections
                    module.w2.mul_(RESIDUAL_SCALE)
        if not model.ties_embeddings:  # tied: the head already is the embedding
            assert isinstance(model.model.embed_tokens, nn.Embedding) and isinstance(model.lm_head, nn.Linear)
            embed, head = model.model.embed_tokens.weight, model.lm_head.weight
            if embed.shape != head.shape:
                raise ValueError(f"echo dummy weights need the LM head's rows to be the embedding's, "
                                 f"got {tuple(head.shape)} against {tuple(embed.shape)}")
            head.copy_(embed)


def _scale_projection(module: nn.Linear | fp8.Fp8Linear) -> None:
    if isinstance(module, fp8.Fp8Linear):  # its FP8 weight stays; its scales carry the factor
        module.scales.mul_(RESIDUAL_SCALE)
    else:
        assert module.weight.dtype != FP8_DTYPE, "an FP8 weight outside Fp8Linear"
        module.weight.mul_(RESIDUAL_SCALE)
    if getattr(module, "bias", None) is not None:
        module.bias.mul_(RESIDUAL_SCALE)
