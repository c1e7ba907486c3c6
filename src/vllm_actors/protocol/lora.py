"""``LoRARequest``: the adapter a request runs with (vLLM's), as the offline API takes it and the
wire carries it (``AddRequest.lora_request``, ``NewRequest.lora_request``)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """``LoRARequest(lora_name, lora_int_id, lora_path)``: the adapter at ``lora_path`` (a PEFT
    directory), known to the engine by ``lora_int_id`` (>= 1; one id, one adapter) and to clients by
    ``lora_name`` (the model name the server routes)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")

    # vLLM's short names
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
