"""The EAGLE-3 head's runner (speculative decoding, ``method: eagle3``), beside the target's in the
same worker (``ModelRunner.drafter``).

It installs the target's hidden-state hook (``models/eagle3.AuxHiddenStates``) before the target
sizes its pool (so the profiling pass counts the fused states' activations) and after every
reload of the target's weights. Its KV (one layer) and the fused states (one row per slot) are
tensors of its own under the target's block ids: the pool is sized with their bytes per block
added to the target's. Its passes run eagerly (no CUDA graphs).

Refused: a target outside Llama/Qwen3 (no hook), a head of another vocabulary or hidden size;
tensor, pipeline and KV parallelism are refused for every drafter (``protocol/config.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.kernels.attention import build_attention_metadata, get_attention_backend
from vllm_actors.models.eagle3 import AuxHiddenStates, Eagle3Config, Eagle3Head, has_own_embedding
from vllm_actors.models.meta_init import materialize, meta_modules


class Eagle3Runner:
    def __init__(self, path: str, target: Any) -> None:
        """``target``: the target's ``ModelRunner``, its weights loaded, its pool not sized yet."""
        self.target = target
        self.device: torch.device = target.device
        self.dtype: torch.dtype = target.dtype
        self.block_size: int = target.block_size
        self.max_num_tokens: int = target.max_num_tokens
        self.config = Eagle3Config.from_path(path, target.model_config)
        dummy = target.config.load_format == "dummy"
        with meta_modules():
            head = Eagle3Head(self.config, own_embedding=not dummy and has_own_embedding(path))
        self.head = materialize(head.to(dtype=self.dtype), self.device)
        with torch.no_grad():
            self.head.d2t.zero_()
            if dummy:  # random weights of the head's shapes (benchmarks), norms at 1
                generator = torch.Generator(device=self.device).manual_seed(target.config.seed + 1)
                for name, parameter in self.head.named_parameters():
                    if name.endswith("norm.weight"):
                        parameter.fill_(1.0)
                    elif parameter.is_floating_point():
                        parameter.normal_(0.0, 0.02, generator=generator)
            else:
                self.head.load(path)
        self.head.eval()
        self.hook = AuxHiddenStates(self.config.aux_layers, self.head.fc)
        self.attach(target.model)
        self.backend = get_attention_backend(self.device)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def attach(self, model: Any) -> None:
        """The hook on the target's forward pass (again after a reload of its weights)."""
        model.aux_hidden = self.hook

    @property
    def bytes_per_block(self) -> int:
        """The head's KV and the fused states of one block (they share the target's block ids)."""
        mc = self.config.model
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.block_size * (2 * mc.num_key_value_heads * mc.head_dim + mc.hidden_size) * element

    def take_pool(self, num_blocks: int, max_model_len: int, enforce_eager: bool) -> None:
        """The head's KV and the fused states for the target's ``num_blocks`` (before its graphs are
        captured: they write the fused states too)."""
        mc = self.config.model
        shape = (num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                         torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.hook.fused = torch.zeros((num_blocks * self.block_size + 1, mc.hidden_size), dtype=self.dtype,
                                      device=self.device)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        own = self.head.embed_tokens
        return F.embedding(ids, own.weight if own is not None else self.target.model.model.embed_tokens.weight)

    @torch.inference_mode()
    def execute(self, batch: BatchInput, ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of the head over ``batch``: input ids ``ids`` (else ``batch.token_ids``), hidden
        states ``hidden`` (else the target's fused states at the batch's slots). Returns the draft
        ids (target vocabulary) and the pre-norm outputs of the rows ``batch.logits_indices``."""
        assert self.kv_cache is not None and self.hook.fused is not None
        meta = build_attention_metadata(batch.query_lens, batch.seq_lens, batch.block_tables, self.block_size,
                                        self.device)
        meta = self.backend.prepare(meta)
        if ids is None:
            ids = upload(batch.token_ids, self.device)
        if hidden is None:
            hidden = self.hook.fused.index_select(0, meta.slot_mapping)
        positions = upload(batch.positions, self.device)
        normed, prenorm = self.head(self._embed(ids), hidden, positions, meta, self.kv_cache, self.backend)
        rows = upload(batch.logits_indices, self.device)
        return self.head.draft_ids(normed.index_select(0, rows)), prenorm.index_select(0, rows)
