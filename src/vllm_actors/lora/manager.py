"""The worker's adapters: loaded on first use into a host cache (``max_cpu_loras``, least recently
used dropped first), copied into one of ``max_loras`` device slots when a step needs them (the
least recently used slot that this step does not use is taken over), and the step's per-token
slots written into the model's ``LoRABatch``.

``attach_lora`` gives every decoder layer of a ``CausalLM`` its ``LayerLoRA`` hooks; the model
calls them after each projection (``models/llama.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch

from vllm_actors.lora.adapter import FUSED_PARTS, load_adapter, read_adapter
from vllm_actors.lora.slots import FusedLoRA, LayerLoRA, LoRABatch
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.runner.staging import StagingSets

log = structlog.get_logger(__name__)

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    def __init__(self, model: Any, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 max_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        """``model``: a ``CausalLM`` (its hooks are attached here); ``max_tokens``: the most token
        rows a forward pass takes (padded graph rows included)."""
        self.model = model
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.device = device
        self.batch = LoRABatch(max_tokens, max_loras, device)
        self.layers: list[dict[str, FusedLoRA]] = []
        local = model.local_config
        outputs = {"qkv": (local.q_size, local.kv_size, local.kv_size), "o": (local.hidden_size,),
                   "gate_up": (local.intermediate_size, local.intermediate_size), "down": (local.hidden_size,)}
        inputs = {"qkv": local.hidden_size, "o": local.q_size, "gate_up": local.hidden_size,
                  "down": local.intermediate_size}
        for index, layer in enumerate(model.model.layers):
            names = ("qkv", "o") if index in model.config.moe_layers else tuple(FUSED_PARTS)
            modules = {name: FusedLoRA(max_loras, max_lora_rank, inputs[name], outputs[name], device, dtype)
                       for name in names}
            self.layers.append(modules)
            hook = LayerLoRA(self.batch, modules)
            layer.self_attn.lora = hook
            if index not in model.config.moe_layers:
                layer.mlp.lora = hook
        model.lora_batch = self.batch
        self.cpu: OrderedDict[int, tuple[str, Weights]] = OrderedDict()  # adapter id -> (path, weights)
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        pin = device.type == "cuda"
        # the step's per-token slots, staged in two host buffers in turn (refilled once copied: staging.py)
        self._host = StagingSets(lambda: torch.full((max_tokens,), -1, dtype=torch.int32, pin_memory=pin), device)
        self._written = 0  # leading device entries that may hold a slot (the rest are -1)

    # ------------------------------------------------------------------ adapters
    def _weights(self, lora: LoRARequest) -> Weights:
        cached = self.cpu.get(lora.lora_int_id)
        if cached is not None and cached[0] == lora.lora_path:
            self.cpu.move_to_end(lora.lora_int_id)
            return cached[1]
        spec = read_adapter(lora.lora_path, self.model.config, self.max_lora_rank)
        weights = load_adapter(spec, self.model.layout)
        self.cpu[lora.lora_int_id] = (lora.lora_path, weights)
        while len(self.cpu) > self.max_cpu_loras:
            dropped, _ = self.cpu.popitem(last=False)
            log.info("lora_dropped_from_host", lora_int_id=dropped)
        log.info("lora_loaded", lora_name=lora.lora_name, lora_int_id=lora.lora_int_id, rank=spec.rank)
        return weights

    def _slot(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The adapter's device slot, loading it into one (free, else the least recently used
        that this step does not use)."""
        adapter_id = lora.lora_int_id
        if adapter_id in self.slots and self.cpu.get(adapter_id, ("",))[0] == lora.lora_path:
            self.slots.move_to_end(adapter_id)
            return self.slots[adapter_id]
        weights = self._weights(lora)
        taken = set(self.slots.values())
        free = [slot for slot in range(self.max_loras) if slot not in taken]
        if adapter_id in self.slots:  # the same id under another path: replaced in place
            slot = self.slots.pop(adapter_id)
        elif free:
            slot = free[0]
        else:
            victim = next((other for other in self.slots if other not in in_use), None)
            if victim is None:
                raise ValueError(f"a step uses more than max_loras={self.max_loras} adapters")
            slot = self.slots.pop(victim)
        for layer, modules in enumerate(self.layers):
            for name, fused in modules.items():
                fused.write(slot, [weights.get((layer, part)) for part in FUSED_PARTS[name]])
        self.slots[adapter_id] = slot
        return slot

    # ------------------------------------------------------------------ steps
    def prepare(self, loras: Sequence[LoRARequest | None] | None, query_lens: Sequence[int]) -> None:
        """Write the step's per-token slots (each sequence's adapter over its ``query_lens`` tokens)
        before its forward pass; ``loras`` None: no sequence has one."""
        num_tokens = int(sum(query_lens))
        in_use = {lora.lora_int_id for lora in loras or () if lora is not None}
        if len(in_use) > self.max_loras:
            raise ValueError(f"a step uses {len(in_use)} adapters, more than max_loras={self.max_loras}")
        if not in_use and self._written == 0:
            return  # the device buffer is all -1 already
        per_seq = np.array([-1 if lora is None else self._slot(lora, in_use) for lora in loras or ()]
                           or [-1] * len(query_lens), dtype=np.int32)
        host = self._host.acquire()
        view = host.numpy()
        view[:num_tokens] = np.repeat(per_seq, np.asarray(query_lens, dtype=np.int64))
        span = max(num_tokens, self._written)
        view[num_tokens:span] = -1
        self.batch.token_slots[:span].copy_(host[:span], non_blocking=True)
        self._host.enqueued()
        self._written = num_tokens if in_use else 0
