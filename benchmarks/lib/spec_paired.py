"""Paired rounds for ``benchmarks/spec_decode.py``: several engines (one per mode) measured in turns,
so that a neighbour's load or the GPU's clock state falls on every mode alike.

Every engine gets the same warm-up; then each round runs each phase (batch 1, then each concurrency)
on every mode back to back, the modes' order reversed every other round (off, ngram; ngram, off; ...).
Per mode the keys of ``spec_measure.measure`` (``batch1_ms_per_token``: the median of every round's
requests; ``concurrency_N_tok_s``: the median over rounds), each round's figures (``rounds``), and
against the baseline mode the per-round paired ratio (``paired_vs_<baseline>``: batch-1 speedup,
tok/s ratio per concurrency; median, min and max over rounds).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.lib.spec_measure import Counters, Generate, batch1, concurrent, drafting, warm_up

COUNTER_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "steps", "drained_steps")


def measure_paired(generates: Mapping[str, Generate], prompts: Sequence[Sequence[int]], output_len: int,
                   repeats: int, concurrency: Sequence[int], rounds: int,
                   counters: Mapping[str, Counters] | None = None, baseline: str = "off",
                   batch_repeats: int = 1) -> dict[str, dict[str, Any]]:
    """Each mode's figures (see the module's docstring), measured in ``rounds`` paired rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    modes = list(generates)
    phases = ["batch1"] + [f"concurrency_{count}" for count in concurrency]
    for mode in modes:
        warm_up(generates[mode], prompts)
    per_round: dict[str, dict[str, list[float]]] = {mode: {phase: [] for phase in phases} for mode in modes}
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    totals: dict[str, dict[str, dict[str, int]]] = {
        mode: {phase: dict.fromkeys((*COUNTER_KEYS, "tokens"), 0) for phase in phases} for mode in modes}
    for round_index in range(rounds):
        order = modes if round_index % 2 == 0 else modes[::-1]
        for phase in phases:
            for mode in order:
                before = counters[mode]() if counters else {}
                if phase == "batch1":
                    found, tokens = batch1(generates[mode], prompts, output_len, repeats)
                    samples[mode] += found
                    value = statistics.median(found)
                else:
                    value, tokens = concurrent(generates[mode], prompts, int(phase.split("_")[1]), output_len,
                                               batch_repeats)
                per_round[mode][phase].append(value)
                total = totals[mode][phase]
                total["tokens"] += tokens
                if counters:
                    after = counters[mode]()
                    for key in COUNTER_KEYS:
                        total[key] += after.get(key, 0) - before.get(key, 0)
    results = {mode: summarize(per_round[mode], samples[mode], totals[mode] if counters else None)
               for mode in modes}
    if baseline in results:
        for mode in modes:
            if mode != baseline:
                results[mode][f"paired_vs_{baseline}"] = paired_ratios(per_round[mode], per_round[baseline])
    return results


def summarize(per_round: dict[str, list[float]], samples: list[float],
              totals: dict[str, dict[str, int]] | None) -> dict[str, Any]:
    """One mode's keys as ``spec_measure.measure`` gives them, over every round, and each round's figures."""
    result: dict[str, Any] = {"batch1_ms_per_token": statistics.median(samples), "batch1_samples": samples}
    rounds: dict[str, list[float]] = {"batch1_ms_per_token": per_round["batch1"]}
    for phase, values in per_round.items():
        if phase != "batch1":
            result[f"{phase}_tok_s"] = statistics.median(values)
            rounds[f"{phase}_tok_s"] = values
    result["rounds"] = rounds
    if totals is not None:
        result["phase_drafting"] = {phase: drafting({}, total, total["tokens"]) for phase, total in totals.items()}
    return result


def paired_ratios(mode: dict[str, list[float]], baseline: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Per round, the mode against the baseline measured beside it: batch-1 speedup (the baseline's
    ms/token over the mode's) and, per concurrency, tok/s over the baseline's (above 1: faster)."""
    found = {"batch1_speedup": spread([b / m for m, b in zip(mode["batch1"], baseline["batch1"], strict=True)])}
    for phase, values in mode.items():
        if phase != "batch1":
            found[f"{phase}_ratio"] = spread([m / b for m, b in zip(values, baseline[phase], strict=True)])
    return found


def spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def paired_line(mode: str, baseline: str, ratios: dict[str, dict[str, Any]]) -> str:
    """One printed line: each phase's median ratio and its range over rounds."""
    parts = [f"{phase.removesuffix('_ratio').replace('concurrency_', 'c')} x{r['median']:.3f} "
             f"[{r['min']:.3f}, {r['max']:.3f}]" for phase, r in ratios.items()]
    return f"ours {mode} / {baseline}, paired over {len(next(iter(ratios.values()))['rounds'])} rounds: " + \
        ", ".join(parts)
