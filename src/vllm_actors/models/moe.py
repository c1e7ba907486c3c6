"""The sparse MLP block of a mixture-of-experts layer (Qwen3-MoE, Mixtral; ``models/moe_config.py``).

Every expert's gate and up projections are stacked into one ``w13`` [E, 2I, H] (gate rows, then up
rows) and its down projection into ``w2`` [E, H, I], filled at load from the checkpoint's tensors
of one expert each (views: ``hf_named_weights``). Under tensor parallelism I is this rank's slice
of every expert's intermediate size and the output is its partial sum, as a dense MLP's; the router
is replicated, so every rank routes every token alike.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_actors.kernels.fused_moe import fused_moe, route
from vllm_actors.kernels.gemv import linear
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.moe_config import EXPERT_BLOCK, EXPERT_PROJECTIONS


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        """``config``: the rank's local config (its slice of the experts' intermediate size)."""
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.architecture = config.architecture

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(linear(x, self.gate), self.top_k, self.renormalize)
        return fused_moe(x, self.w13, self.w2, weights, ids)  # this rank's partial sum

    def hf_named_weights(self, layer_prefix: str) -> dict[str, torch.Tensor]:
        """This block's weights under the checkpoint's names (``layer_prefix``: "model.layers.{i}."):
        the router, and views of each expert's rows of ``w13`` and ``w2``."""
        block = f"{layer_prefix}{EXPERT_BLOCK[self.architecture]}"
        gate, up, down = EXPERT_PROJECTIONS[self.architecture]
        inter = self.w2.shape[2]
        named = {f"{block}.gate.weight": self.gate.weight}
        for expert in range(self.w13.shape[0]):
            named[f"{block}.experts.{expert}.{gate}.weight"] = self.w13[expert, :inter]
            named[f"{block}.experts.{expert}.{up}.weight"] = self.w13[expert, inter:]
            named[f"{block}.experts.{expert}.{down}.weight"] = self.w2[expert]
        return named
