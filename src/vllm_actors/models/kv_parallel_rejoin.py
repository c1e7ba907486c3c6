"""A surviving KV-parallel rank's new world, with the respawned rank in place of the dead one.

The survivors keep their process, model and KV cache: they leave the old world and join a new one
(a new rendezvous, the same ranks and size), then make the same groups again in the same order
(``join_kv_parallel``). Leaving must not wait for the dead peer:

- gloo (the CPU): a collective with a dead peer fails at once on its closed socket (``Connection
  closed by peer``), so the survivor is out of it and destroys the world.
- NCCL (GPUs; not run in CI): a collective with a dead peer never completes, and the host waits on
  the stream behind it, so the step's thread cannot leave by itself. Another thread of the survivor
  (the one that learns of the rejoin) aborts every communicator (``_abort_process_group``: NCCL's
  ``ncclCommAbort``, which ends the stuck kernels; the step's thread then fails), then the world is
  destroyed. ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` must not tear the process down first (its watchdog
  acts only after the collectives' timeout, ``TP_TIMEOUT``).

Only KV parallelism without tensor parallelism is covered: a TP group's symmetric memory and fused
all-reduce buffers are mapped per peer and would have to be made again too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from vllm_actors.models.kv_parallel import KvParallel, join_kv_parallel
from vllm_actors.models.parallel import TP_TIMEOUT


def leave_world(on_cuda: bool) -> None:
    """Leave the current world without waiting for a dead peer (NCCL: its communicators aborted
    first, from any thread); nothing when there is none."""
    if not dist.is_initialized():
        return
    if on_cuda:
        c10d._abort_process_group()  # every group, WORLD included: stuck collectives end
    dist.destroy_process_group()


def rejoin_kv_parallel(old: KvParallel, init_method: str, device: torch.device) -> KvParallel:
    """This rank's KV-parallel group again, at ``init_method`` (the respawned rank's rendezvous),
    for the same rank and size. The model's attention backend must then be installed again
    (``KvParallel.install``): the old one gathers over the old group."""
    if not old.enabled:
        raise ValueError("only a KV-parallel rank (kv_parallel_size >= 2) rejoins its group")
    if old.world_size != old.size:
        raise ValueError(f"a KV-parallel rank with tensor parallelism ({old.world_size // old.size} ranks each) "
                         "cannot rejoin alone: its whole group restarts")
    on_cuda = device.type == "cuda"
    leave_world(on_cuda)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init_method, rank=old.global_rank,
                            world_size=old.world_size, timeout=TP_TIMEOUT, device_id=device if on_cuda else None)
    return join_kv_parallel(old.global_rank, 1, old.size)
