"""The throughput benchmark's option values that need more than a type: each parsed and checked,
an ``argparse.ArgumentTypeError`` saying what is allowed otherwise."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_actors.models.router_skew import parse_skew


def stages_arg(text: str) -> int:
    """``--pipeline-parallel-size``'s value: a whole number of stages, at least 1."""
    try:
        stages = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of pipeline stages, got {text!r}") from None
    if stages < 1:
        raise argparse.ArgumentTypeError(f"at least 1 pipeline stage, got {stages}")
    return stages


def router_skew_arg(text: str) -> str:
    """``--moe-router-skew``'s value, normalised (``zipf:1.20`` -> ``zipf:1.2``)."""
    try:
        return parse_skew(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None


def moe_config_arg(text: str) -> str:
    """``--moe-config``'s value: a readable fused-MoE table (``kernels/moe_config.py``), as an absolute path."""
    from vllm_actors.kernels.moe_config import parse_tables

    path = Path(text).resolve()
    try:
        parse_tables(path.read_text(), str(path))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} ({exc.strerror})") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return str(path)
