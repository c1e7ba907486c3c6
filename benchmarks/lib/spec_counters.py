"""Speculative-decoding counters of both engines in ``benchmarks/spec_decode.py``, and the per-step
figures derived from them, so that the engines compare per verification step whatever their drafts'
acceptance (vLLM's dummy weights make its draft model agree with its target; ours reject).

vLLM's side reads ``LLM.get_metrics()`` (vLLM V1, with ``disable_log_stats=False``): a list of
``vllm.v1.metrics.reader`` metrics, ``Counter`` (``.value``) for ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens`` and ``..._num_accepted_tokens``, ``Vector`` (``.values``) for
``..._num_accepted_tokens_per_pos``; one of each per label set (per engine under data parallelism),
summed here. Imports nothing of vllm_actors or vllm: ``peer_spec.py`` runs it under vLLM's Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

VLLM_COUNTERS = {"num_drafts": "vllm:spec_decode_num_drafts",
                 "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def vllm_totals(metrics: Iterable[Any]) -> dict[str, Any]:
    """The speculative-decoding totals in ``spec_measure``'s keys from vLLM's metrics (absent: 0)."""
    keys = {name: key for key, name in VLLM_COUNTERS.items()}
    totals: dict[str, Any] = dict.fromkeys(VLLM_COUNTERS, 0)
    per_pos: list[int] = []
    for metric in metrics:
        name = getattr(metric, "name", None)
        if name in keys:
            totals[keys[name]] += int(metric.value)
        elif name == VLLM_PER_POS:
            values = [int(value) for value in metric.values]
            per_pos += [0] * (len(values) - len(per_pos))
            per_pos = [total + (values[pos] if pos < len(values) else 0) for pos, total in enumerate(per_pos)]
    totals["accepted_per_pos"] = per_pos
    return totals


class VllmCounters:
    """``spec_measure``'s ``Counters`` over a vLLM ``LLM``. Never raises: the first failure of
    ``get_metrics`` (an engine without it, stats disabled) is kept in ``note`` and every later call
    returns the last totals read, so the caller drops the phases' figures when ``note`` is set."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.note: str | None = None
        self.last: dict[str, Any] = vllm_totals([])

    def __call__(self) -> dict[str, Any]:
        if self.note is None:
            try:
                self.last = vllm_totals(self.llm.get_metrics())
            except Exception as error:  # noqa: BLE001  # any vLLM without the API: a note, never a failed run
                self.note = f"unavailable: {type(error).__name__}: {error}"
        return dict(self.last)


def step_figures(phase: Mapping[str, Any]) -> dict[str, Any] | None:
    """A phase's figures per request-step from its drafting (``spec_measure.drafting``): every
    request-step gave one token and its accepted drafts, so ``tokens_per_step`` is tokens over
    (tokens - accepted), counting the steps that did not draft; ``mean_acceptance_length`` is vLLM's
    1 + accepted / drafts, over the steps that drafted; ``acceptance_rate`` accepted over drafted."""
    tokens = int(phase.get("tokens", 0))
    if tokens <= 0:
        return None
    drafts, drafted, accepted = (int(phase.get(key, 0)) for key in VLLM_COUNTERS)
    return {"tokens_per_step": tokens / max(tokens - accepted, 1),
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_rate": accepted / drafted if drafted else None}


def step_cost(result: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """Per phase of a mode's result (``phase_drafting``) its step figures, and at batch 1 the step's
    cost: ``ms_per_step`` = batch-1 ms/token x tokens per step. None without drafting figures."""
    phases = result.get("phase_drafting")
    if not isinstance(phases, Mapping):
        return None
    found = {phase: figures for phase, drafting in phases.items() if (figures := step_figures(drafting))}
    ms_per_token = result.get("batch1_ms_per_token")
    if "batch1" in found and isinstance(ms_per_token, int | float):
        found["batch1"]["ms_per_step"] = ms_per_token * found["batch1"]["tokens_per_step"]
    return found or None


def step_line(mode: str, costs: Mapping[str, Mapping[str, Any] | None]) -> str:
    """One printed line: each engine's batch-1 ms per step, tokens per step and acceptance in ``mode``."""
    parts = []
    for engine, cost in costs.items():
        batch1 = (cost or {}).get("batch1")
        if not batch1 or "ms_per_step" not in batch1:
            parts.append(f"{engine} n/a")
            continue
        rate = batch1["acceptance_rate"]
        parts.append(f"{engine} {batch1['ms_per_step']:.3f} ms/step ({batch1['tokens_per_step']:.2f} tokens/step, "
                     f"acceptance {'-' if rate is None else f'{rate:.2f}'})")
    return f"step cost {mode}, batch 1: " + ", ".join(parts)
