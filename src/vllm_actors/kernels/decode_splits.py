"""How many programs split each (sequence, KV head) context of a decode step (``triton_decode``'s split-K),
chosen on the host from integers, without Triton (the runner asks whether a step's graph suits it)."""

from __future__ import annotations

import functools
import math

import torch

_MIN_KEYS_PER_SPLIT = 128
# From sweeps over the decode batches of a serving workload (benchmarks/RESULTS.md): programs per SM the
# context split aims at, the most splits per (sequence, KV head).
DECODE_WAVES = 2
DECODE_MAX_SPLITS = 64  # a power of two: bounds the reduce kernel's compiled variants
# Few (sequence, KV head) programs (batch 1-2 of long contexts): a program a SM cannot keep enough loads
# in flight, so the context is split for twice the waves and tiles take 2 stages (benchmarks/decode_long.py
# on an H100: 64 splits, 2 stages, 92-101% of the copy bandwidth at 128k-1M keys against 90-96% before).
FEW_PROGRAMS_PER_SM = 1 / 8
FEW_PROGRAMS_WAVES = 4
# A decode step whose longest context has at least LONG_DECODE_KEYS keys and asks for GRAPH_SPLITS_SHORTFALL
# times the splits its graph was captured with runs eagerly (``decode_graph_falls_short``).
LONG_DECODE_KEYS = 32_768
GRAPH_SPLITS_SHORTFALL = 4


def few_programs(num_seqs: int, num_kv_heads: int, sm_count: int) -> bool:
    """Whether a decode launch has so few (sequence, KV head) pairs that it takes the few-programs tuning."""
    return num_seqs * num_kv_heads <= sm_count * FEW_PROGRAMS_PER_SM


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                         waves: int = DECODE_WAVES, max_splits: int = DECODE_MAX_SPLITS,
                         total_seq_len: int | None = None) -> int:
    """Splits of the context per (sequence, KV head): enough programs for about ``waves`` waves on
    the GPU (``FEW_PROGRAMS_WAVES`` for few programs), but no split shorter than _MIN_KEYS_PER_SPLIT
    keys and at most ``max_splits`` (1: no reduction kernel); rounded down to a power of two (bounds
    the reduce kernel's compiled variants). With ``total_seq_len`` (the batch's keys, where the host
    knows them), the longest sequence's programs are held to a wave's share of the batch's keys: one
    400k-token context among 120 of 2k took 85 ms a step (H200, 1B shape) in one program per head while
    the other programs were long done; with uniform lengths the same count as without.
    Chosen at graph capture for CUDA graphs (uniform lengths: ``decode_graph_falls_short``)."""
    if waves < 1:
        raise ValueError(f"waves must be a positive integer, got {waves}")
    if not 1 <= max_splits <= DECODE_MAX_SPLITS or max_splits & (max_splits - 1):
        raise ValueError(f"max_splits must be a power of two in 1..{DECODE_MAX_SPLITS}, got {max_splits}")
    programs = max(1, num_seqs * num_kv_heads)
    sm_count = _sm_count(device)
    if waves == DECODE_WAVES and few_programs(num_seqs, num_kv_heads, sm_count):
        waves = FEW_PROGRAMS_WAVES
    wanted = math.ceil(waves * sm_count / programs)
    if total_seq_len is not None and total_seq_len > 0:  # the longest context's share of the batch's keys
        wanted = max(wanted, math.ceil(waves * sm_count * max_seq_len / (num_kv_heads * total_seq_len)))
    useful = math.ceil(max(1, max_seq_len) / _MIN_KEYS_PER_SPLIT)
    splits = max(1, min(wanted, useful, max_splits))
    return 1 << (splits.bit_length() - 1)


def decode_graph_falls_short(seq_lens: list[int], graph_size: int, num_kv_heads: int, max_model_len: int,
                             device: torch.device) -> bool:
    """Whether a decode step would replay a graph captured with far fewer splits than its lengths ask for
    (``choose_decode_splits``: at capture every length is taken as ``max_model_len``, so a batch of many
    sequences gets few splits; one long context among short ones then runs in a few long programs): the
    runner runs such a step eagerly, its splits chosen from the step's own lengths."""
    longest = max(seq_lens, default=0)
    if longest < LONG_DECODE_KEYS:
        return False
    captured = choose_decode_splits(graph_size, num_kv_heads, max_model_len, device)
    wanted = choose_decode_splits(len(seq_lens), num_kv_heads, longest, device, total_seq_len=sum(seq_lens))
    return wanted >= GRAPH_SPLITS_SHORTFALL * captured
