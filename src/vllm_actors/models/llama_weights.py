"""A checkpoint loaded into ``CausalLM`` (which mixes this in): this rank's part of every weight
read from a ``TensorSource`` into the parameters ``hf_named_weights`` names (q/k/v and gate/up as
views into their merged parameters), the checkpoint's KV scales kept for ``init_kv_scales``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vllm_actors.kernels.fp8_gemm import FP8_DTYPE
from vllm_actors.models.fp8 import Fp8Source
from vllm_actors.models.fused_names import split_fused
from vllm_actors.models.kv_scales import is_kv_scale_name, read_kv_scales
from vllm_actors.models.tensor_source import DictSource, TensorSource

if TYPE_CHECKING:
    from vllm_actors.models.config import ModelConfig
    from vllm_actors.models.parallel import ShardLayout, TensorParallel
    from vllm_actors.models.pipeline import PipelineStage


class CheckpointWeights(nn.Module):
    """The weight loading of ``CausalLM``."""

    if TYPE_CHECKING:  # provided by CausalLM
        config: ModelConfig
        tp: TensorParallel
        stage: PipelineStage
        layout: ShardLayout
        checkpoint_kv_scales: dict[int, dict[str, float]]

        def hf_named_weights(self) -> dict[str, torch.Tensor]: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face-named state dict in place (q/k/v and gate/up into their merged
        parameters, this rank's shard of each); missing or unexpected names raise."""
        self.load_from(DictSource(state_dict))

    def load_from(self, source: TensorSource) -> None:
        """Read this rank's part of every weight from ``source`` (only that part: a safetensors
        source reads just those rows or columns); missing or unexpected names raise."""
        targets = self.hf_named_weights()  # tied weights appear once, as model.embed_tokens.weight
        source = split_fused(source, self.config)  # Phi-3's fused qkv_proj and gate_up_proj, by part
        if self.config.quantization is not None:  # FP8 weights: kept where the model holds FP8, else dequantized
            fp8_names = {name for name, target in targets.items() if target.dtype == FP8_DTYPE}
            source = Fp8Source(source, self.config.quantization, fp8_names)
        given = {name: name for name in source.names() if not is_kv_scale_name(name)}
        self.checkpoint_kv_scales = read_kv_scales(source.names(), source, self.config.num_hidden_layers)
        if self.config.tie_word_embeddings:
            lm = given.pop("lm_head.weight", None)
            if "model.embed_tokens.weight" not in given and lm is not None:
                given["model.embed_tokens.weight"] = lm
            if "lm_head.weight" in targets:  # a last stage without the embedding: its own copy
                given["lm_head.weight"] = given["model.embed_tokens.weight"]
        given = {name: read for name, read in given.items() if self.stage.owns(name, self.config.num_hidden_layers)}
        missing = sorted(set(targets) - set(given))
        unexpected = sorted(set(given) - set(targets))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
        with torch.no_grad():
            for name, source_name in given.items():
                target = targets[name]
                if self.layout.rank0_only(name) and self.tp.rank != 0:
                    target.zero_()  # a row-parallel bias counts once, on rank 0
                    continue
                part = self.layout.slice_of(name)
                shape = source.shape(source_name)
                expected = list(target.shape)
                if part is not None:
                    expected[part.dim] = part.full
                if shape != expected:
                    raise ValueError(f"{name}: shape {tuple(shape)} != expected {tuple(expected)}")
                tensor = source.read(source_name, part)
                rows = tensor.shape[0]  # the last rank's vocabulary shard may be short: zero rows pad it
                target[:rows].copy_(tensor)
                target[rows:].zero_()
                if self.config.gemma_norms and name.endswith("norm.weight"):
                    target.add_(1.0)  # Gemma's RMSNorm scales by (1 + w): folded in once here
