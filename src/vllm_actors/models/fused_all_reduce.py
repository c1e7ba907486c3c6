"""The symmetric buffers of the fused all-reduce + add + RMSNorm (`kernels/allreduce_norm.py`).

One object per rank owns one allocation of torch's symmetric memory, mapped by every rank of the
group, cut into ``SLOTS`` slots of ``max_bytes``: one per call site, so that consecutive calls never
write the buffer a peer may still be reading (see the kernel's docstring). The call sites of the
decoder, in the order a forward pass runs them, are the embedding's all-reduce (before the first
norm), each layer's attention output (before ``post_attention_layernorm``) and MLP output (before
the next layer's ``input_layernorm``, or the final norm): EMBED, ATTN, MLP, ATTN, MLP, ..., MLP,
then EMBED again for the next step. No slot is used twice without another call between.

``VLLM_ACTORS_TP_FUSED_NORM=0`` turns it off (NCCL or the two-shot all-reduce, then the norm kernel);
``FUSED_MAX_BYTES`` (8 MiB) bounds the all-reduces it takes, larger ones (long prefill chunks) go
the unfused way. ``VLLM_ACTORS_TP_ALLREDUCE=nccl`` turns it off too.
``VLLM_ACTORS_TP_FUSED_LAMPORT=0`` takes the flagged kernel instead of the flagless one (the
default): the flagless kernel needs room for every rank's rows in a slot, so it takes all-reduces of
up to ``max_bytes / world``, and its slots are filled with EMPTY once, before the first call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_actors.envs import Envs

SLOT_EMBED, SLOT_ATTN, SLOT_MLP = 2, 0, 1
SLOTS = 3
FUSED_ENV = "VLLM_ACTORS_TP_FUSED_NORM"
FUSED_MAX_BYTES = 8 << 20  # a slot's bytes: the largest all-reduce it takes (the flagless kernel: / world)
EMPTY_BYTE = 0xFF  # the flagless kernel's EMPTY pattern: every bit set
MAX_COLUMNS = 16384  # one row is one block of the kernel's registers


class FusedAllReduceNorm:
    """This rank's slots of the symmetric buffer and the pointer tables the kernel reads."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int, lamport: bool = False) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from vllm_actors.kernels.allreduce_norm import MAX_PROGRAMS

        self.max_bytes = max_bytes
        self.lamport = lamport  # each rank stores its rows into every peer's slot (rank-major regions)
        self.buffer = symm_mem.empty(SLOTS * max_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)  # a collective: every rank allocates
        self.rank, self.world = handle.rank, handle.world_size
        pad_bytes = symm_mem.get_signal_pad_size()
        if pad_bytes < MAX_PROGRAMS * self.world * 4:
            raise RuntimeError(f"the symmetric memory signal pad ({pad_bytes} bytes) is too small for "
                               f"{MAX_PROGRAMS} programs of {self.world} ranks")
        self.buffer_ptrs = [torch.tensor([base + slot * max_bytes for base in handle.buffer_ptrs],
                                         dtype=torch.int64, device=device) for slot in range(SLOTS)]
        self.pad_ptrs = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.handle = handle  # keeps the peers' mappings alive as long as the tables point at them
        if lamport:  # every slot EMPTY before any peer may store into it
            import torch.distributed as dist

            self.buffer.fill_(EMPTY_BYTE)
            torch.cuda.synchronize(device)
            dist.barrier(group=group)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] <= MAX_COLUMNS
                and x.numel() * x.element_size() * (self.world if self.lamport else 1) <= self.max_bytes
                and (not self.lamport or x.element_size() in (2, 4)))  # EMPTY is a 16- or 32-bit pattern

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, slot: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm_actors.kernels.allreduce_norm import all_reduce_rms_norm

        return all_reduce_rms_norm(x, self.buffer_ptrs[slot], self.pad_ptrs, self.rank, weight, eps, residual,
                                   lamport=self.lamport)


def fused_from_env(
    environ: Mapping[str, str] | None, group: Any, device: torch.device | None
) -> FusedAllReduceNorm | None:
    """The fused all-reduce + norm unless turned off or off the GPU (``device`` None: gloo);
    ``environ`` None: this process's environment."""
    settings = Envs(environ)
    if device is None or not settings.VLLM_ACTORS_TP_FUSED_NORM or settings.VLLM_ACTORS_TP_ALLREDUCE == "nccl":
        return None
    return FusedAllReduceNorm(group, device, FUSED_MAX_BYTES, lamport=settings.VLLM_ACTORS_TP_FUSED_LAMPORT)
