"""``benchmarks/host_turns.py``'s sizes: the turn prompts, the GPU pool, the filler requests that push
the first turn's blocks out of it, and the host memory that keeps them all.

A cycle: turn 1 (a prompt of ``turn1_prompt`` tokens, ``turn_output`` tokens decoded), fillers
(fresh prompts of ``filler_lens`` tokens, one token each, one at a time), turn 2 (turn 1's prompt,
its output and ``new_tokens`` more; one token). Turn 2 fills the context but a margin, so every
request fits ``max_model_len`` = the context. The pool holds ``pool_factor`` contexts (turn 1 fits
whole, nothing else does); the fillers hold ``filler_factor`` pools together, so the pool's last
``pool_blocks`` are theirs when turn 2 comes and none of turn 1's is left on the GPU. The host tier
(ours) or CPU buffer (vLLM) holds turn 1's blocks and every filler's, with ``HOST_MARGIN`` more:
a tier that dropped its oldest blocks for room would drop turn 1's first.

Imports nothing of vllm_actors or vLLM (benchmarks.lib.floor for the KV's size only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.lib.floor import GIB, ModelShape

PROMPT_MARGIN = 16  # tokens of the context left free beyond turn 2's prompt and its token
POOL_FACTOR = 1.3  # the GPU pool in contexts
FILLER_FACTOR = 1.5  # the fillers' tokens in pools
HOST_MARGIN = 1.1  # the host memory over what turn 1 and the fillers take
HOST_GIB_STEP = 0.01  # the host memory is rounded up to this many GiB


@dataclass(frozen=True)
class TurnsPlan:
    context: int  # max_model_len: turn 2's prompt, its token and the margin
    block_size: int
    turn1_prompt: int
    turn_output: int  # turn 1's decoded tokens, part of turn 2's prompt
    new_tokens: int  # turn 2's tokens past turn 1's prompt and output
    pool_blocks: int  # the GPU pool (num_gpu_blocks_override)
    filler_lens: tuple[int, ...]  # the filler prompts, one token each
    host_gib: float  # ours: kv_cache_offload_gb; vLLM: kv_offloading_size

    @property
    def turn2_prompt(self) -> int:
        return self.turn1_prompt + self.turn_output + self.new_tokens

    @property
    def filler_tokens(self) -> int:
        return sum(self.filler_lens)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "filler_lens": list(self.filler_lens), "turn2_prompt": self.turn2_prompt,
                "filler_tokens": self.filler_tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TurnsPlan:
        return cls(context=int(data["context"]), block_size=int(data["block_size"]),
                   turn1_prompt=int(data["turn1_prompt"]), turn_output=int(data["turn_output"]),
                   new_tokens=int(data["new_tokens"]), pool_blocks=int(data["pool_blocks"]),
                   filler_lens=tuple(int(n) for n in data["filler_lens"]), host_gib=float(data["host_gib"]))


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int) -> int:
    """One token's keys and values over every layer (one GPU: no tensor parallelism)."""
    shape = ModelShape.from_hf_config(config, dtype_bytes=dtype_bytes)
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * dtype_bytes


def split_evenly(total: int, most: int) -> tuple[int, ...]:
    """``total`` tokens as the fewest prompts of at most ``most`` tokens, as equal as can be."""
    if total < 1 or most < 1:
        raise ValueError(f"cannot split {total} tokens into prompts of at most {most}")
    count = math.ceil(total / most)
    base, extra = divmod(total, count)
    return tuple(base + 1 if index < extra else base for index in range(count))


def host_gib_for(tokens: int, bytes_per_token: int) -> float:
    """GiB for ``tokens`` tokens of KV and ``HOST_MARGIN``, rounded up to ``HOST_GIB_STEP``."""
    steps = math.ceil(tokens * bytes_per_token * HOST_MARGIN / GIB / HOST_GIB_STEP - 1e-9)
    return round(max(1, steps) * HOST_GIB_STEP, 6)


def plan_turns(context: int, turn_output: int, new_tokens: int, block_size: int, bytes_per_token: int,
               pool_factor: float = POOL_FACTOR, filler_factor: float = FILLER_FACTOR,
               host_gib: float | None = None) -> TurnsPlan:
    """The sizes of a cycle at ``context`` tokens (see the module's docstring); ``host_gib``: the
    host memory given instead of the one that holds turn 1 and the fillers."""
    if turn_output < 1 or new_tokens < 1 or block_size < 1:
        raise ValueError("turn 1's output, turn 2's new tokens and the block size must be at least 1")
    if pool_factor < 1.0 or filler_factor <= 1.0:
        raise ValueError(f"the pool must hold a context (pool factor {pool_factor} < 1) and the fillers more "
                         f"than the pool (filler factor {filler_factor} <= 1)")
    turn1 = context - turn_output - new_tokens - 1 - PROMPT_MARGIN
    if turn1 < block_size:
        raise ValueError(f"context {context} leaves no turn-1 prompt of a block for {turn_output} output tokens, "
                         f"{new_tokens} new tokens and a margin of {PROMPT_MARGIN}")
    pool_blocks = math.ceil(pool_factor * context / block_size)
    fillers = split_evenly(math.ceil(filler_factor * pool_blocks * block_size), context - 1 - PROMPT_MARGIN)
    if host_gib is None:
        host_gib = host_gib_for(turn1 + turn_output + new_tokens + sum(fillers), bytes_per_token)
    elif host_gib <= 0:
        raise ValueError(f"the host memory must be positive, got {host_gib} GiB")
    return TurnsPlan(context=context, block_size=block_size, turn1_prompt=turn1, turn_output=turn_output,
                     new_tokens=new_tokens, pool_blocks=pool_blocks, filler_lens=fillers, host_gib=host_gib)
