"""Borrowed KV capacity in a replica's worker (``kv_borrowing``): every worker of the set is a home
for its own guests and a lender for the other replicas' at once.

At start each replica's worker joins a set-wide gloo group (rank: its replica; a file store in the
group's run directory) and a second one for the exchanges, whose timeout outlasts any idle time (a
lender's thread waits for its home's next layer under it), puts ``BorrowingAttention`` around its
model's backend and starts one ``LenderServer`` thread per other replica, answering that replica's
layers on its own caches. Per
plan: a lender takes the block ids its KV-cache manager reserved (``StepPlan.lent_block_ids``) and
forgets the returned loans; a home opens a guest's row with placeholders where the lenders' blocks
sit (``NewRequest.borrowed``) and names the step's guests by their index in its batch; a step with
a guest runs eagerly (``begin_step`` says so: the worker marks its batch, and the runner replays no
CUDA graph for it). A set-wide gloo group does not take a restarted worker back: when one fails the
supervisor restarts every replica's worker together, at a fresh store, and each replica recovers its
requests by recomputing them.

q, k, v and the answers lie in shared memory between the replicas of the host
(``models/kv_borrow_shm.py``; ``VLLM_ACTORS_BORROW_TRANSPORT=gloo``: their bytes over gloo), the gloo
group carrying the headers. On GPUs (one per replica) they go through that host memory too
(``models/kv_borrow_link.py`` says why not NCCL); the home's share and each lender's are attended on
the GPU kernels of KV parallelism where the attention setting picks Triton for the device
(``kv_parallel.gpu_partial_attention``), the lender's on a CUDA stream of its thread's own.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog

from vllm_actors.envs import Envs
from vllm_actors.models.kv_borrow import BorrowingAttention, Guest, LenderShare
from vllm_actors.models.kv_borrow_link import (
    LenderServer,
    QkvStaging,
    RemoteLender,
    SharedRegions,
    exchange_group,
)
from vllm_actors.models.kv_parallel import gpu_partial_attention
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.runtime.shm_regions import region_prefix

if TYPE_CHECKING:
    from vllm_actors.actors.worker.block_tables import BlockTableArray
    from vllm_actors.actors.worker.step_data import WorkerRequest

log = structlog.get_logger(__name__)

JOIN_TIMEOUT = timedelta(minutes=10)  # the set's workers load their models before they meet
# SWITCH: a lender thread takes the GIL back after each blocking receive and each torch call of a layer's answer; a
# main thread running Python (its own steps' preparation) hands it over only at Python's switch interval (5 ms),
# so every layer of a guest's step could wait several of those (two H200s: ~6-8 ms a layer of exchange for under
# 1 MB). ``VLLM_ACTORS_BORROW_SWITCH_US`` (200 us by default) shortens it in a borrowing worker. On the CPU
# (``benchmarks/kv_borrow_exchange.py --busy-lender prep``): the lender's attend alone 2.85 ms at 5 ms, 0.13 at 200 us.


class KvBorrowing:
    """A worker's side of borrowed KV: its lenders (one ``RemoteLender`` per other replica), its
    share of other replicas' requests, its guests."""

    def __init__(self, backend: BorrowingAttention, share: LenderShare, lenders: Mapping[int, Any],
                 regions: SharedRegions | None = None) -> None:
        self.backend, self.share, self.lenders = backend, share, dict(lenders)
        self.regions = regions  # the shared-memory regions it writes and reads (None: all over gloo)
        self.guests: dict[str, Guest] = {}

    def apply(self, plan: StepPlan, requests: Mapping[str, WorkerRequest], tables: BlockTableArray | None) -> None:
        """After the plan's membership changes: its loans, then its new guests' placeholder rows."""
        if plan.reset:
            self.guests.clear()
            for request_id in list(self.share.loans):
                self.share.give_back(request_id)
        for request_id in plan.returned_loans:
            self.share.give_back(request_id)
        for request_id, block_ids in plan.lent_block_ids.items():
            self.share.lend(request_id, block_ids)
        for request_id in plan.finished_ids:
            self.guests.pop(request_id, None)
        for new in plan.new_requests:
            self.guests.pop(new.request_id, None)
            if not new.borrowed:
                continue
            unknown = [replica for replica, _ in new.borrowed if replica not in self.lenders]
            if unknown:
                raise ValueError(f"request {new.request_id!r} borrows from replicas {unknown}, not in this set")
            self.guests[new.request_id] = Guest(new.request_id, [(self.lenders[r], n) for r, n in new.borrowed])
            placeholders = [0] * sum(count for _, count in new.borrowed)
            request = requests[new.request_id]
            request.block_table.extend(placeholders)
            if tables is not None:
                tables.append(request.row, placeholders)

    def begin_step(self, req_ids: list[str]) -> bool:
        """The step's guests, by their index in its batch; whether it has one (then it runs eagerly)."""
        guests = self.guests
        step = {index: guests[r] for index, r in enumerate(req_ids) if r in guests} if guests else {}
        self.backend.begin_step(step)
        return bool(step)


def shorten_switch_interval(environ: Mapping[str, str] | None = None) -> float:
    """Python's switch interval as ``VLLM_ACTORS_BORROW_SWITCH_US`` sets it for a borrowing worker (``SWITCH``;
    0 leaves it); returns it in seconds."""
    switch_us = Envs(environ).VLLM_ACTORS_BORROW_SWITCH_US
    if switch_us:
        sys.setswitchinterval(switch_us / 1e6)
    return sys.getswitchinterval()


def join_borrowing(runner: Any, replica: int, num_replicas: int, run_dir: str, rendezvous: str = "") -> KvBorrowing:
    """Join the set's gloo group, wrap the model's attention and start the lender threads. ``rendezvous``: where
    a set's workers restarted together meet (a fresh store each time; "" at the first start: the run directory's)."""
    import torch.distributed as dist

    from vllm_actors.kernels.attention import get_attention_backend

    shorten_switch_interval()

    dist.init_process_group("gloo", init_method=rendezvous or f"file://{run_dir}/kv-borrowing.store", rank=replica,
                            world_size=num_replicas, timeout=JOIN_TIMEOUT)
    # the exchanges' own group: under the world's timeout an idle lender's receive failed after 10 min
    group = exchange_group(num_replicas)
    model = runner.model
    device = runner.kv_caches[0][0].device  # with its index (the runner's may have none)
    kernels = gpu_partial_attention(device)  # None: the torch loop (the CPU)
    backend = BorrowingAttention(model.attn_backend or get_attention_backend(device), runner.block_size, kernels)
    model.attn_backend = backend
    share = LenderShare(runner.kv_caches, kernels=kernels)
    config = runner.local_config
    # q, k and v and the answers in shared memory (the replicas of one host), sized for a step's tokens
    regions = SharedRegions(region_prefix(run_dir), runner.max_num_tokens, device) \
        if Envs().VLLM_ACTORS_BORROW_TRANSPORT == "shm" else None
    for home in range(num_replicas):
        if home != replica:
            LenderServer(share, home, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         runner.dtype, group, regions, replica).start()
    staging = QkvStaging(regions, replica)  # q, k and v on the host once a layer, for every lender
    lenders = {peer: RemoteLender(peer, group, staging) for peer in range(num_replicas) if peer != replica}
    log.info("kv_borrowing_joined", replica=replica, replicas=num_replicas, device=str(device),
             attention=backend.name, partials="triton" if kernels is not None else "torch",
             transport="shm" if regions is not None else "gloo")
    return KvBorrowing(backend, share, lenders, regions)
