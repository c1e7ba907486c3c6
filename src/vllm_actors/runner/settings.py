"""The worker's switches read from the environment (handed to ``Worker`` by ``build_worker``)."""

from __future__ import annotations

from vllm_actors.envs import envs


def defer_steps() -> bool:
    """VLLM_ACTORS_DEFER_STEPS=0: workers read every step back before launching the next."""
    return envs.VLLM_ACTORS_DEFER_STEPS


def tp_graph_draws() -> bool:
    """VLLM_ACTORS_TP_GRAPH_SAMPLER (default 1): under tensor parallelism every rank draws a sampling
    decode graph's tokens itself (no eager sampler on rank 0, no broadcast); 0: rank 0 draws and
    broadcasts (``benchmarks/RESULTS.md`` has the comparison)."""
    return envs.VLLM_ACTORS_TP_GRAPH_SAMPLER


def graph_sampler_enabled() -> bool:
    """Capture decode graphs that draw the tokens too (``VLLM_ACTORS_GRAPH_SAMPLER=0``: sample on the
    host side after the replay; on by default, ``benchmarks/RESULTS.md`` has the comparison)."""
    return envs.VLLM_ACTORS_GRAPH_SAMPLER


def spec_overlap() -> bool:
    """VLLM_ACTORS_SPEC_OVERLAP=0: an n-gram verification step is read back before the next step launches."""
    return envs.VLLM_ACTORS_SPEC_OVERLAP
