"""Sleep mode's device memory: the model's tensors moved to host memory (or dropped) and back.

vLLM keeps the same device addresses across a sleep (its CuMem allocator unmaps and remaps the
pages), so its CUDA graphs stay valid. Here the tensors' storage is swapped in place
(``tensor.data``): every module, and anything holding the same tensor object, sees the restored
values, but at new addresses. So the runner drops its CUDA graphs when it sleeps (their pool is
device memory too) and captures them again once weights and KV cache are both back.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


def device_tensors(model: torch.nn.Module, device_type: str) -> list[torch.Tensor]:
    """Every tensor the model's modules hold on the device: parameters, buffers and plain tensor
    attributes (derived weights a model keeps beside its parameters), each once."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    for module in model.modules():
        held = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for tensor in held:
            if isinstance(tensor, torch.Tensor) and tensor.device.type == device_type and id(tensor) not in seen \
                    and tensor.numel():
                seen.add(id(tensor))
                found.append(tensor)
    return found


class WeightStash:
    """The model's device tensors while asleep: copies in host memory (``offload``, level 1) or
    nothing (``discard``, level 2: the checkpoint is read again)."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the model's tensor, its host copy)

    @property
    def holds_copies(self) -> bool:
        return bool(self._saved)

    def offload(self, model: torch.nn.Module, device: torch.device) -> None:
        pin = device.type == "cuda"
        with torch.inference_mode(False), torch.no_grad():
            for tensor in device_tensors(model, device.type):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                host.copy_(tensor)
                self._saved.append((tensor, host))
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    @staticmethod
    def discard(model: torch.nn.Module, device: torch.device) -> None:
        with torch.inference_mode(False), torch.no_grad():
            for tensor in device_tensors(model, device.type):
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)

    def restore(self, device: torch.device) -> None:
        """Each offloaded tensor back on the device, with its values (new storage)."""
        with torch.inference_mode(False), torch.no_grad():
            for tensor, host in self._saved:
                tensor.data = host.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._saved = []


def release_device_memory(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the device (``mem_get_info`` sees them)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class _Runner(Protocol):
    """What sleep mode reads and sets of its ``ModelRunner``."""

    device: torch.device
    model: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def drop_graphs(self) -> None: ...

    def capture_graphs(self) -> None: ...

    def make_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def reload_model(self) -> None: ...


class SleepMode:
    """The runner's sleep: which of "weights" and "kv_cache" sleep, and how the weights come back."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        self.asleep: set[str] = set()
        self.stash = WeightStash()

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"level: must be 1 or 2, got {level}")
        runner = self.runner
        runner.drop_graphs()  # they read the old addresses (and their pool is device memory)
        if "kv_cache" not in self.asleep:
            runner.kv_caches = []
        if "weights" not in self.asleep:
            if level == 1:
                self.stash.offload(runner.model, runner.device)
            else:
                self.stash.discard(runner.model, runner.device)
        self.asleep = {"weights", "kv_cache"}
        release_device_memory(runner.device)

    def wake_up(self, tags: list[str]) -> None:
        runner = self.runner
        if "weights" in tags and "weights" in self.asleep:
            if self.stash.holds_copies:
                self.stash.restore(runner.device)
            else:
                runner.reload_model()  # level 2: from the checkpoint
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            runner.kv_caches = runner.make_kv_cache()  # empty: the pipeline restarts after a sleep
            self.asleep.discard("kv_cache")
        if not self.asleep:
            runner.capture_graphs()
