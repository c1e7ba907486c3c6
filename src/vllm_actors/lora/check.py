"""A client's check of the adapters it sends (the offline API, the server): LoRA enabled, and the
adapter at its path fits the base model, before the request leaves (``read_adapter``)."""

from __future__ import annotations

from vllm_actors.lora.adapter import read_adapter
from vllm_actors.models.config import ModelConfig
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.lora import LoRARequest


class AdapterCheck:
    def __init__(self, enable_lora: bool, max_lora_rank: int, model: str) -> None:
        """``model``: the base model's path (its config.json or GGUF header is read on first use)."""
        self.enable_lora, self.max_lora_rank, self.model = enable_lora, max_lora_rank, model
        self._base: ModelConfig | None = None
        self._checked: set[tuple[int, str]] = set()

    @classmethod
    def of(cls, config: EngineConfig) -> AdapterCheck:
        return cls(config.enable_lora, config.max_lora_rank, config.model)

    def __call__(self, lora: LoRARequest | None) -> None:
        """ValueError unless ``lora`` (None: the base model) can be served."""
        if lora is None:
            return
        if not self.enable_lora:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is not enabled: "
                             "start the engine with enable_lora=True (--enable-lora)")
        if (lora.lora_int_id, lora.lora_path) in self._checked:
            return
        if self._base is None:
            self._base = ModelConfig.from_path(self.model)
        read_adapter(lora.lora_path, self._base, self.max_lora_rank)
        self._checked.add((lora.lora_int_id, lora.lora_path))
