"""A model runner's KV-parallel rank rejoining its group (the worker's ``kv_rejoin.Rejoiner``): the
survivors leave the world and join the respawned rank's rendezvous, keeping model and KV cache, and
install the attention backend again over the new group (``models/kv_parallel_rejoin.py``)."""

from __future__ import annotations

from typing import Any

from vllm_actors.models.kv_parallel_rejoin import rejoin_kv_parallel


class RunnerRejoin:
    """``runner``: a ``ModelRunner`` of KV parallelism without TP or PP; ``rendezvous``: where it
    joined its world (a respawned rank joined the new one at start: it does not rejoin)."""

    def __init__(self, runner: Any, rendezvous: str) -> None:
        self.runner = runner
        self.rendezvous = rendezvous

    @property
    def size(self) -> int:
        return int(self.runner.kvp.size)

    @property
    def block_size(self) -> int:
        return int(self.runner.block_size)

    @property
    def max_num_tokens(self) -> int:
        return int(self.runner.max_num_tokens)

    def rejoin(self, init_method: str) -> None:
        if init_method == self.rendezvous:
            return
        self.runner.kvp = rejoin_kv_parallel(self.runner.kvp, init_method, self.runner.device)
        self.runner.kvp.install(self.runner.model, self.runner.block_size)
        self.rendezvous = init_method


def rejoiner_for(runner: Any, rendezvous: str, tp_size: int, pipeline: bool) -> RunnerRejoin | None:
    """Where a rank can rejoin alone: KV parallelism without tensor or pipeline parallelism, on the
    CPU (gloo; on GPUs a survivor's step waits in NCCL until another thread aborts it: not wired)."""
    kvp = getattr(runner, "kvp", None)
    if kvp is None or not kvp.enabled or tp_size > 1 or pipeline or not rendezvous:
        return None
    if getattr(runner, "device", None) is None or runner.device.type != "cpu":
        return None
    return RunnerRejoin(runner, rendezvous)
