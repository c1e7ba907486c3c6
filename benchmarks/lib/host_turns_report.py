"""``benchmarks/host_turns.py``'s report: every engine and mode's result merged into ``results.json``
(a later call with ``--append`` replaces the modes it runs again), the comparisons, and the table
``host_turns.md``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.lib.long_context_model import context_label

ENGINE_ORDER = ("ours", "vllm")
MODE_ORDER = ("host", "recompute")
MODE_NAMES = {("ours", "host"): "host KV tier", ("ours", "recompute"): "no tier: recompute",
              ("vllm", "host"): "CPU offloading", ("vllm", "recompute"): "no offloading: recompute"}


def new_report(config: dict[str, Any]) -> dict[str, Any]:
    return {"config": config, "runs": [], "results": {}, "rows": [], "errors": {}}


def load_report(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def key(engine: str, mode: str) -> str:
    return f"{engine}/{mode}"


def add_result(report: dict[str, Any], engine: str, mode: str, result: dict[str, Any], log: str,
               error: str | None) -> None:
    """One engine process's result (what it wrote, even if it failed): its run, and its cycles,
    which replace that engine and mode's earlier ones."""
    error = error or result.get("error")
    report["runs"].append({"engine": engine, "mode": mode, "log": log, "error": error,
                           **{k: result.get(k) for k in ("startup_s", "warmup_s", "settings", "python")}})
    report["results"][key(engine, mode)] = {k: result.get(k) for k in ("summary", "cycles", "warmup_cycles")}
    report["results"][key(engine, mode)]["run"] = len(report["runs"]) - 1
    if error:
        report["errors"][key(engine, mode)] = error
    else:
        report["errors"].pop(key(engine, mode), None)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _summary(report: Mapping[str, Any], engine: str, mode: str) -> Mapping[str, Any] | None:
    return (report["results"].get(key(engine, mode)) or {}).get("summary")


def build_rows(report: dict[str, Any]) -> None:
    """A row per engine and mode: both turns' TTFT, turn 2's tokens by source, and turn 2's TTFT
    over the same engine's recompute mode (``vs_recompute``) and over the other engine's in the same
    mode (ours only: ``ours_vs_vllm``). ``same_token``: turn 2's greedy tokens equal to the
    recompute mode's (the same prompts: a restored prefix must give the token a recomputed one does)."""
    found = {tuple(name.split("/")) for name in report["results"]}
    engines = [e for e in ENGINE_ORDER if any(f[0] == e for f in found)]
    engines += sorted({f[0] for f in found} - set(engines))
    report["rows"] = []
    for engine in engines:
        for mode in MODE_ORDER:
            if (engine, mode) not in found:
                continue
            row: dict[str, Any] = {"engine": engine, "mode": mode, "label": MODE_NAMES.get((engine, mode), mode)}
            summary = _summary(report, engine, mode)
            if summary is None:
                row["error"] = report["errors"].get(key(engine, mode)) or "not measured"
                report["rows"].append(row)
                continue
            row.update({k: summary.get(k) for k in (
                "repeats", "turn1_ttft_ms", "turn1_e2e_ms", "turn2_ttft_ms", "turn2_ttft_ms_samples",
                "turn2_prompt_len", "turn2_computed_tokens", "turn2_restored_tokens", "turn2_gpu_hit_tokens",
                "turn2_cached_tokens")})
            recompute = _summary(report, engine, "recompute")
            row["vs_recompute"] = _ratio(summary["turn2_ttft_ms"], recompute["turn2_ttft_ms"]) \
                if recompute is not None and mode != "recompute" else None
            row["same_token"] = summary["turn2_tokens"] == recompute["turn2_tokens"] \
                if recompute is not None and mode != "recompute" else None
            peer = _summary(report, "vllm", mode) if engine == "ours" else None
            row["ours_vs_vllm"] = _ratio(summary["turn2_ttft_ms"], peer["turn2_ttft_ms"]) if peer else None
            report["rows"].append(row)


def _number(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if abs(value) >= 10 ** (1 - digits) or value == 0 else f"{value:.3g}"


def _tokens(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def format_markdown(report: Mapping[str, Any]) -> str:
    config, plan = report["config"], report["config"].get("plan") or {}
    context = plan.get("context")
    lines = [
        f"Host KV tier: the next turn of a {context_label(context) if context else '?'}-token conversation "
        f"({config.get('model_description')}, {config.get('dtype')}) whose prefix was pushed out of the GPU pool.",
        f"Turn 1: {_tokens(plan.get('turn1_prompt'))} prompt tokens, {plan.get('turn_output')} decoded; fillers: "
        f"{len(plan.get('filler_lens') or [])} prompts, {_tokens(plan.get('filler_tokens'))} tokens; turn 2: "
        f"{_tokens(plan.get('turn2_prompt'))} prompt tokens (turn 1's and {plan.get('new_tokens')} new), one token. "
        f"GPU pool {_tokens(plan.get('pool_blocks'))} blocks of {plan.get('block_size')}; host memory "
        f"{plan.get('host_gib')} GiB (ours: kv_cache_offload_gb, vLLM: kv_offloading_size).",
        "TTFT by the client's clock, median over the cycles; turn 2's prompt tokens by where their KV came from "
        "(restored from host memory, found in the GPU pool, computed).",
        "",
        "| engine | mode | turn-1 TTFT (ms) | turn-2 TTFT (ms) | turn-2 samples (ms) | restored | GPU hit | computed "
        "| turn 2 / recompute | ours / vLLM | same token |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['engine']} | {row['label']} | {row['error'][:80]} | | | | | | | | |")
            continue
        samples = ", ".join(_number(s) for s in row["turn2_ttft_ms_samples"] or [])
        same = {None: "-", True: "yes", False: "NO"}[row["same_token"]]
        lines.append(
            f"| {row['engine']} | {row['label']} | {_number(row['turn1_ttft_ms'])} | {_number(row['turn2_ttft_ms'])} "
            f"| {samples} | {_tokens(row['turn2_restored_tokens'])} | {_tokens(row['turn2_gpu_hit_tokens'])} "
            f"| {_tokens(row['turn2_computed_tokens'])} | {_number(row['vs_recompute'], 2)} "
            f"| {_number(row['ours_vs_vllm'], 2)} | {same} |")
    startups = [f"{run['engine']} {run['mode']} {run['startup_s']:.1f} s" for run in report["runs"]
                if run.get("startup_s")]
    if startups:
        lines += ["", "Engine startup: " + ", ".join(startups) + "."]
    for name, error in report["errors"].items():
        lines.append(f"{name} failed: {error}")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out_dir / "host_turns.md").write_text(format_markdown(report))
