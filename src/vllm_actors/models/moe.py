"""The sparse MLP block of a mixture-of-experts layer (Qwen3-MoE, Mixtral; ``models/moe_config.py``).

Every expert's gate and up projections are stacked into one ``w13`` [E, 2I, H] (gate rows, then up
rows) and its down projection into ``w2`` [E, H, I], filled at load from the checkpoint's tensors
of one expert each (views: ``hf_named_weights``). Under tensor parallelism I is this rank's slice
of every expert's intermediate size and the output is its partial sum, as a dense MLP's; the router
is replicated, so every rank routes every token alike.

``VLLM_ACTORS_MOE_ROUTER_SKEW`` (benchmarks only; off by default) replaces the router's logits with
rows of a Zipf-skewed table after the router ran (``models/router_skew.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_actors.envs import envs
from vllm_actors.kernels.fused_moe import fused_moe, route_for_experts
from vllm_actors.kernels.gemv import linear
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.moe_config import EXPERT_BLOCK, EXPERT_PROJECTIONS
from vllm_actors.models.router_skew import RouterSkew, make_table, skewed_logits

# the skewed router's table, one per (skew, experts, device) for every layer of the process
_SKEW_TABLES: dict[tuple[RouterSkew, int, str], torch.Tensor] = {}


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        """``config``: the rank's local config (its slice of the experts' intermediate size);
        ``layer``: the decoder layer's index (where a skewed router starts in its table)."""
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = nn.Linear(hidden, experts, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.architecture = config.architecture
        self.layer = layer
        self.router_skew = envs.VLLM_ACTORS_MOE_ROUTER_SKEW

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self.gate)
        if self.router_skew is not None:
            logits = skewed_logits(self._skew_table(x.device), x.shape[0], self.layer, logits.dtype)
        weights, ids, blocks = route_for_experts(x, self.w13, logits, self.top_k, self.renormalize)
        return fused_moe(x, self.w13, self.w2, weights, ids, blocks)  # this rank's partial sum

    def _skew_table(self, device: torch.device) -> torch.Tensor:
        """Built by the first forward, before any CUDA graph is captured (warm-ups run first)."""
        assert self.router_skew is not None
        key = (self.router_skew, self.gate.weight.shape[0], str(device))
        if key not in _SKEW_TABLES:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the skewed router's table must be built by a forward before graph capture")
            _SKEW_TABLES[key] = make_table(self.router_skew, key[1], device)
        return _SKEW_TABLES[key]

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
