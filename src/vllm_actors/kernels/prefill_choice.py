"""Which kernel attends a prefill (or mixed) step: the project's Triton varlen kernel, or flash-attn 4's
SM90 kernel (``kernels/flash_attn_prefill.py``) where it is installed, can take the step and measured
faster. Pure host logic on integers: no flash-attn, no device work here.

``VLLM_ACTORS_PREFILL_ATTENTION``: ``triton`` never takes flash-attn; ``flash_attn`` takes it for every
step it can run (and makes its absence an error); ``auto`` (default) takes it from the query lengths
and the context before them where ``benchmarks/prefill_attention.py`` measured it faster. Decode steps
(every query length <= 1) always stay on the Triton decode kernel.
"""

from __future__ import annotations

from typing import Literal

from vllm_actors.envs import envs

PrefillKernel = Literal["triton", "flash_attn"]
PREFILL_CHOICES = ("auto", "triton", "flash_attn")

# auto: flash-attn 4 from this longest query of a step (``max_query_len``, the chunk) up, per head_dim;
# a head_dim not listed takes the largest. Set from the thresholds benchmarks/prefill_attention.py
# measures at block size 16 (its report prints this line); measured on an H100 (benchmarks/RESULTS.md).
FLASH_ATTN_MIN_QUERY_LEN: dict[int, int] = {64: 2048, 128: 2048}
# auto: flash-attn 4 also takes a shorter chunk over a long cached context: from LONG_CONTEXT_MIN_QUERY_LEN
# tokens over LONG_CONTEXT_KEYS keys before it, it measured 1.04-2.35x Triton's on the H200 (both shapes, block
# sizes 16 and 128; RESULTS.md, twentieth session). Beside decodes only at head_dim 128: at 64 it lost (0.72-0.77x).
LONG_CONTEXT_KEYS = 8192
LONG_CONTEXT_MIN_QUERY_LEN = 256
MIXED_LONG_CONTEXT_MIN_HEAD_DIM = 128
# ... and at a smaller head_dim beside other sequences when the long query's attention dwarfs theirs: flash-attn 4
# runs each other sequence's row as a whole tile of query rows over its keys (a decode fills 1/32 of it with GQA
# packed), so it counts their keys this many times over. Its losses at head_dim 64 (0.72-0.85x) were chunks of
# 512-1,024 over 16k keys (8-17M pairs) beside 63 decodes of 16k (1M keys): below the line; a 256-token chunk of a
# 1M-token prompt beside 147 decodes of 2k (110M pairs, 0.3M keys) ran Triton at 84 TFLOP/s (one H200, RESULTS.md,
# twenty-first session), where flash-attn 4 reaches 164-197 alone.
MIXED_KEYS_WEIGHT = 64
# auto: where the longest query is split over its keys (``flash_attn_split``: too short to fill the GPU over a
# long context), flash-attn 4 takes it from this many tokens: the split restores the parallelism a short chunk
# lacks, which is what held it back below LONG_CONTEXT_MIN_QUERY_LEN.
SPLIT_MIN_QUERY_LEN = 64


def prefill_choice() -> str:
    """``auto``, ``triton`` or ``flash_attn``: what ``VLLM_ACTORS_PREFILL_ATTENTION`` asks for."""
    return str(envs.VLLM_ACTORS_PREFILL_ATTENTION)


def min_query_len(head_dim: int) -> int:
    """The shortest longest-query from which ``auto`` takes flash-attn 4 at this head_dim."""
    return FLASH_ATTN_MIN_QUERY_LEN.get(head_dim, max(FLASH_ATTN_MIN_QUERY_LEN.values()))


def prefill_kernel(choice: str, flash_attn_ready: bool, max_query_len: int, head_dim: int,
                   context_len: int = 0, num_seqs: int = 1, other_keys: int = 0, split: bool = False) -> PrefillKernel:
    """The kernel of a step whose longest query is ``max_query_len`` over ``context_len`` keys cached
    before it, among ``num_seqs`` sequences whose others hold ``other_keys`` keys together.
    ``flash_attn_ready``: flash-attn 4 is installed, the device is Hopper and the step's layout suits it
    (dtype, head_dim). ``split``: flash-attn would split that query over its keys."""
    if choice not in PREFILL_CHOICES:
        raise ValueError(f"prefill attention must be one of {', '.join(PREFILL_CHOICES)}, got {choice!r}")
    if max_query_len <= 1 or choice == "triton" or not flash_attn_ready:
        return "triton"
    if choice == "flash_attn" or max_query_len >= min_query_len(head_dim):
        return "flash_attn"
    shortest = SPLIT_MIN_QUERY_LEN if split else LONG_CONTEXT_MIN_QUERY_LEN
    if max_query_len >= shortest and context_len >= LONG_CONTEXT_KEYS \
            and (num_seqs == 1 or head_dim >= MIXED_LONG_CONTEXT_MIN_HEAD_DIM
                 or max_query_len * (context_len + max_query_len) >= MIXED_KEYS_WEIGHT * other_keys):
        return "flash_attn"
    return "triton"
