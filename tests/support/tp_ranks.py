"""Per-rank bodies of the tensor-parallel tests, run by ``torch.multiprocessing.spawn`` (module
level, so the spawned interpreters can import them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Chunks of token ids per sequence and step: two prompts prefilled in pieces, then decode steps.
STEPS: list[dict[int, list[int]]] = [
    {0: [5, 17, 42, 7, 99, 3], 1: [200, 201, 202]},
    {0: [11, 12, 13], 1: [300, 301, 302, 303, 304, 305, 306]},
    {0: [77], 1: [78]},
    {0: [500], 1: [1]},
    {0: [250], 1: [260]},
]


def sharded_logits(model_path: str, tp_size: int, rank: int = 0) -> list[dict[int, torch.Tensor]]:
    """Logits of every step of ``STEPS`` through rank ``rank``'s shard (the group already joined)."""
    from tests.support.tiny_models import PagedRunner
    from vllm_actors.models.loader import load_model
    from vllm_actors.models.parallel import TensorParallel

    tp = TensorParallel(rank=rank, size=tp_size)
    model, _ = load_model(model_path, torch.float32, torch.device("cpu"), tp=tp)
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    return [{seq: logits.clone() for seq, logits in runner.step(chunks).items()} for chunks in STEPS]


def run_rank(rank: int, tp_size: int, store: str, model_path: str | list[str], out: str) -> None:
    """One rank: join the gloo group through a file store, run the steps, rank 0 saves the logits
    (of each model in turn when ``model_path`` is a list: one spawn for several models)."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, above ``tests``
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp_size)
    if isinstance(model_path, list):
        results: Any = [sharded_logits(path, tp_size, rank) for path in model_path]
    else:
        results = sharded_logits(model_path, tp_size, rank)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # every rank is done (and rank 0's file written) before any leaves
    # Leave without tearing the gloo group down: a rank whose peers were destroying theirs at the
    # same time still aborted now and then ("terminate called without an active exception", a
    # gloo thread left joinable; 1 in ~10 CI runs of TP=3 even after the barrier). Nothing here
    # needs the teardown: the store is a temporary file and the process ends.
    os._exit(0)
