"""Tensor parallelism's settings: the all-reduce and its fused norm (group ``tp``)."""

from __future__ import annotations

from vllm_actors.envs.parsers import choice, integer
from vllm_actors.envs.setting import Setting, switch


class TensorParallelSettings:
    """The ``tp`` group's settings (``Envs`` inherits them)."""

    VLLM_ACTORS_TP_ALLREDUCE = Setting(
        "symm_mem", choice("nccl", "symm_mem", "symm_mem_one_shot"),
        "All-reduce: two-shot over symmetric memory in its band, one-shot, or NCCL alone.",
        kind="nccl, symm_mem, symm_mem_one_shot", group="tp")
    VLLM_ACTORS_TP_SYMM_MIN_BYTES = Setting(
        64 << 10, integer(0), "Smallest all-reduce through symmetric memory (0 sends every one, as tests do).",
        kind="int", group="tp")
    VLLM_ACTORS_TP_FUSED_NORM = switch("Fused all-reduce + add + RMSNorm over symmetric memory.", "tp")
    VLLM_ACTORS_TP_FUSED_LAMPORT = switch("The flagless fused all-reduce kernel (0: the flagged one).", "tp")
