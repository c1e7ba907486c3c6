"""The one "Triton or torch" decision of every op that has both (attention, fused ops, sampler,
penalties): by the device, unless the op's setting (``vllm_actors.envs``) asks for one of them."""

from __future__ import annotations

import torch

from vllm_actors.envs import Envs, envs

KERNEL_CHOICES = ("VLLM_ACTORS_ATTENTION", "VLLM_ACTORS_FUSED_OPS", "VLLM_ACTORS_FUSED_MOE", "VLLM_ACTORS_SAMPLER",
                  "VLLM_ACTORS_PENALTIES", "VLLM_ACTORS_LORA_KERNEL", "VLLM_ACTORS_FP8_GEMM")
_SETTINGS = {name: Envs.setting(name) for name in KERNEL_CHOICES}  # asked at every op in eager mode: one lookup


def kernel_choice(variable: str) -> str:
    """``auto``, ``torch`` or ``triton``: what ``variable`` (one of ``KERNEL_CHOICES``) asks for."""
    setting = _SETTINGS.get(variable)
    if setting is None:
        raise KeyError(f"{variable} is not a kernel choice ({', '.join(KERNEL_CHOICES)})")
    return str(setting.read(envs.environ))


def use_triton(variable: str, have_triton: bool, device: torch.device) -> bool:
    """The Triton kernel on CUDA devices; ``$variable=torch``: never; ``=triton``: also elsewhere
    (e.g. the CPU under ``TRITON_INTERPRET=1``); never without triton."""
    choice = kernel_choice(variable)
    if not have_triton or choice == "torch":
        return False
    return choice == "triton" or device.type == "cuda"
