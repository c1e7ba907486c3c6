"""A dead KV-parallel rank's share of the requests, and the step that recomputes only that share.

Block id ``b`` lives on rank ``b % size`` (``actors/kv_cache_manager/block_pool.py``). When rank
``r`` dies, the K/V of its blocks is gone and every other rank's is intact. A request's lost
positions are those of its computed tokens whose block rank ``r`` held: about 1/size of them, one
block at a time where placement is interleaved.

The recovery step recomputes them all at once. The attention paths take one contiguous run of
queries per sequence (the torch loop puts query ``j`` at ``seq_len - q_len + j``; the GPU share
kernels derive their bounds the same way), so each run of lost positions becomes a sequence of its
own: ``q_len`` the run's tokens, ``seq_len`` the run's end, the request's whole block table. Each
such sequence attends, by true position and causally, to every rank's keys before it: the
survivors' intact ones, and those of the other lost runs, whose K/V each layer writes before it
attends, layer by layer. The respawned rank stores the runs' K/V; nothing is sampled. Every rank
holds the same block tables, so every rank derives the same step from the dead rank's number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LostRun:
    """Positions ``start`` .. ``start + count - 1`` of a request, whose K/V the dead rank held."""

    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class HeldRequest:
    """What a rank knows of a request: its tokens (prompt, then outputs), block table (global ids)
    and how many of its positions have K/V."""

    token_ids: Sequence[int]
    block_table: Sequence[int]
    num_computed_tokens: int
    # Positions from here (to the computed count) are recomputed on every rank: their K/V was
    # planned by steps lost with the rank, and their blocks cached already (None: none such).
    recompute_from: int | None = None


@dataclass
class RecoveryStep:
    """The recovery step's flattened inputs, as ``step_data.BatchInput`` holds a step's (without
    logits rows: nothing is sampled); kept torch-free like the rest of the bookkeeping."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)  # one sequence per lost run
    seq_lens: list[int] = field(default_factory=list)  # each run's end
    block_tables: list[list[int]] = field(default_factory=list)  # its request's whole table


def check_rank(rank: int, size: int) -> None:
    if size < 2:
        raise ValueError(f"recovering a rank's share needs KV parallelism (kv_parallel_size >= 2), got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"KV-parallel rank {rank} outside a group of {size} (allowed: 0 .. {size - 1})")


def lost_runs(block_table: Sequence[int], num_computed: int, block_size: int, rank: int, size: int,
              recompute_from: int | None = None) -> list[LostRun]:
    """The runs of computed positions (below ``num_computed``) whose blocks rank ``rank`` held, and
    every position from ``recompute_from`` on, adjacent ones joined into one run, in position order."""
    check_rank(rank, size)
    everything_from = num_computed if recompute_from is None else max(recompute_from, 0)
    if num_computed > len(block_table) * block_size:
        raise ValueError(f"{num_computed} computed tokens, but a table of {len(block_table)} blocks of "
                         f"{block_size} holds {len(block_table) * block_size}")
    runs: list[LostRun] = []
    for index, block in enumerate(block_table):
        start = index * block_size
        if start >= num_computed:
            break
        end = min(start + block_size, num_computed)
        if block % size != rank:
            if end <= everything_from:
                continue
            start = max(start, everything_from)
        count = end - start
        if runs and runs[-1].end == start:
            runs[-1] = LostRun(runs[-1].start, runs[-1].count + count)
        else:
            runs.append(LostRun(start, count))
    return runs


def recovery_batch(requests: Sequence[HeldRequest], block_size: int, rank: int, size: int) -> RecoveryStep:
    """The step recomputing every lost position of ``requests``: one sequence per lost run, on its
    request's block table; no logits row (nothing is sampled). Empty when rank ``rank`` held no
    computed position of any of them."""
    batch = RecoveryStep()
    for request in requests:
        if request.num_computed_tokens > len(request.token_ids):
            raise ValueError(f"{request.num_computed_tokens} computed tokens, {len(request.token_ids)} known: "
                             "a token still pending cannot be recomputed")
        for run in lost_runs(request.block_table, request.num_computed_tokens, block_size, rank, size,
                             request.recompute_from):
            batch.token_ids.extend(request.token_ids[run.start:run.end])
            batch.positions.extend(range(run.start, run.end))
            batch.query_lens.append(run.count)
            batch.seq_lens.append(run.end)
            batch.block_tables.append(list(request.block_table))
    return batch


def split_step(step: RecoveryStep, max_tokens: int) -> list[RecoveryStep]:
    """``step`` as consecutive steps of at most ``max_tokens`` tokens each (a run cut where a step
    fills), in order: every piece still follows the pieces before it in its request, so the keys
    it attends to are written by an earlier step or, layer by layer, by its own."""
    if max_tokens < 1:
        raise ValueError(f"a recovery step needs room for at least one token, got max_tokens={max_tokens}")
    steps: list[RecoveryStep] = []
    current = RecoveryStep()
    flat = 0
    for query_len, table in zip(step.query_lens, step.block_tables, strict=True):
        done = 0
        while done < query_len:
            if len(current.token_ids) == max_tokens:
                steps.append(current)
                current = RecoveryStep()
            count = min(query_len - done, max_tokens - len(current.token_ids))
            start = flat + done
            current.token_ids.extend(step.token_ids[start:start + count])
            current.positions.extend(step.positions[start:start + count])
            current.query_lens.append(count)
            current.seq_lens.append(step.positions[start + count - 1] + 1)
            current.block_tables.append(table)
            done += count
        flat += query_len
    if current.token_ids:
        steps.append(current)
    return steps
