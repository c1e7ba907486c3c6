"""A KV-parallel rank restarted alone, as the worker sees it (``Worker`` mixes ``KvRejoining`` in).

A survivor's step fails when its collective meets the dead peer (gloo: at once, on the closed
socket). The survivor then drops that step and every plan after it, keeping its process, model,
requests and KV, until the plan that carries ``KvRejoin``. That plan, applied first on every rank
(the respawned one too, which has held nothing), re-seeds the requests from the scheduler's view:
each running request's known tokens, computed count (the steps in flight are forgotten) and whole
block table. The survivors then join the new rendezvous (``Rejoiner``). Then every rank runs the
recovery step (``lost_share.recovery_batch``): the dead rank's computed positions, recomputed
over the surviving ranks' K/V, nothing sampled. The answering rank publishes ``KV_SHARE_RECOVERED``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from vllm_actors.actors.worker.lost_share import HeldRequest, recovery_batch, split_step
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.protocol.events import KvShareRecovered
from vllm_actors.protocol.messages import KvRejoin, NewRequest
from vllm_actors.protocol.outputs import Outputs

if TYPE_CHECKING:
    from vllm_actors.actors.worker.block_tables import BlockTableArray
    from vllm_actors.actors.worker.engine import Runner
    from vllm_actors.actors.worker.step_data import WorkerRequest

# What a collective with a dead peer raises besides torch's DistError (gloo's closed socket).
LOST_PEER_WORDS = ("closed by peer", "connection reset", "broken pipe", "aborted")


def lost_peer(error: RuntimeError) -> bool:
    """Whether ``error`` is a collective's with a peer that is gone (anything else is a bug)."""
    text = str(error).lower()
    distributed = any(cls.__name__ == "DistError" for cls in type(error).__mro__)  # torch.distributed's own
    return distributed or any(word in text for word in LOST_PEER_WORDS)


class Rejoiner(Protocol):
    """The KV-parallel group as a rank that may rejoin it sees it (``runner.kv_rejoin``)."""

    @property
    def size(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one step takes (the runner's buffers): a longer recovery is split."""
        ...

    def rejoin(self, init_method: str) -> None:
        """Leave the current world (without waiting for a dead peer) and join ``init_method``'s;
        nothing when this rank joined it already (the respawned one)."""
        ...


class KvRejoining:
    """The worker's half of a rank's lone restart: a failed collective, then the rejoin plan."""

    if TYPE_CHECKING:  # provided by Worker
        runner: Runner
        requests: dict[str, WorkerRequest]
        tables: BlockTableArray | None
        answers: bool
        rejoiner: Rejoiner | None
        _lost_peer: bool

        def reset(self) -> None: ...

        def _admit(self, new: NewRequest) -> None: ...

    def _peer_lost(self, error: RuntimeError) -> None:
        """A collective failed: a peer is gone (re-raised where no rejoin can follow: a bug then)."""
        if self.rejoiner is None or not lost_peer(error):
            raise error
        self._lost_peer = True  # every plan is dropped until the rejoin plan

    def _rejoin(self, rejoin: KvRejoin, step_id: int) -> Outputs:
        """Re-seed every request from ``rejoin``, join the new world, recompute the dead rank's share."""
        if self.rejoiner is None:
            raise ValueError("a KV-parallel rejoin plan reached a worker that cannot rejoin "
                             "(only KV parallelism without TP or PP on the CPU can)")
        if len(rejoin.block_tables) != len(rejoin.requests):
            raise ValueError(f"a rejoin plan with {len(rejoin.requests)} requests and {len(rejoin.block_tables)} "
                             "block tables (the KV-cache manager fills one per request)")
        self.reset()  # the KV tensors stay: the survivors' share of every request is in them
        for new, table in zip(rejoin.requests, rejoin.block_tables, strict=True):
            self._admit(new)
            request = self.requests[new.request_id]
            request.block_table.extend(table)
            if self.tables is not None:
                self.tables.append(request.row, list(table))
        self.rejoiner.rejoin(rejoin.init_method)
        self._lost_peer = False
        if rejoin.recompute_from and len(rejoin.recompute_from) != len(rejoin.requests):
            raise ValueError(f"a rejoin plan with {len(rejoin.requests)} requests and {len(rejoin.recompute_from)} "
                             "recompute_from entries (one per request, or none)")
        froms: list[int | None] = list(rejoin.recompute_from) or [None] * len(rejoin.requests)
        held = [HeldRequest(self.requests[new.request_id].token_ids, self.requests[new.request_id].block_table,
                            new.num_cached_tokens, start) for new, start in zip(rejoin.requests, froms, strict=True)]
        step = recovery_batch(held, self.rejoiner.block_size, rejoin.rank, self.rejoiner.size)
        for piece in split_step(step, self.rejoiner.max_num_tokens):  # every rank runs them; nothing is sampled
            self.runner.execute(BatchInput(piece.token_ids, piece.positions, piece.query_lens, piece.seq_lens,
                                           piece.block_tables, []))
        outputs = Outputs()
        if self.answers:
            outputs.emit(KvShareRecovered(step_id=step_id, rank=rejoin.rank, num_requests=len(held),
                                          num_recomputed_tokens=len(step.token_ids),
                                          num_computed_tokens=sum(r.num_computed_tokens for r in held)))
        return outputs
