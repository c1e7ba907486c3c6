"""A KV-parallel rank's body for the rejoin test (``python -m tests.support.kvp_rejoin_rank ROLE
FIRST SECOND``): ``survivor`` (rank 0) and ``doomed`` (rank 1) join at the FIRST rendezvous and
gather once; the survivor then gathers again (the doomed rank never does: it is killed), fails,
rejoins at the SECOND with ``respawned`` (rank 1) and gathers. Each prints what it gathered."""

from __future__ import annotations

import os
import sys
import time

import torch


def gathered(kvp: object, value: float) -> list[float]:
    from vllm_actors.models.kv_parallel import KvParallel

    assert isinstance(kvp, KvParallel)
    return [row[0].item() for row in kvp.all_gather(torch.full((2,), value))]


def main(role: str, first: str, second: str) -> None:
    from vllm_actors.models.kv_parallel import join_kv_parallel
    from vllm_actors.models.kv_parallel_rejoin import rejoin_kv_parallel
    from vllm_actors.models.parallel import join_group

    rank = 0 if role == "survivor" else 1
    join_group(rank, 1, second if role == "respawned" else first, "cpu", pipeline_size=2)
    kvp = join_kv_parallel(rank, 1, 2)
    print(role, os.getpid(), "gathered", gathered(kvp, 10.0 * rank + (5 if role == "respawned" else 0)), flush=True)
    if role == "doomed":
        time.sleep(600)
    if role == "survivor":
        print(role, os.getpid(), "gathering", flush=True)
        try:
            gathered(kvp, 1.0)
        except RuntimeError as error:
            print(role, os.getpid(), "failed", type(error).__name__, flush=True)
        kvp = rejoin_kv_parallel(kvp, second, torch.device("cpu"))
        print(role, os.getpid(), "gathered", gathered(kvp, 2.0), flush=True)
    os._exit(0)  # no teardown of the gloo world (see tp_ranks.run_rank)


if __name__ == "__main__":
    main(*sys.argv[1:4])
