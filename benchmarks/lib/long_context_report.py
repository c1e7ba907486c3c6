"""``benchmarks/long_context.py``'s report: every engine's results merged into one JSON (runs split
over several calls add to it with ``--append``), the decode floor of each context, and the table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.lib.floor import ModelShape
from benchmarks.lib.long_context_chunks import chunk_markdown
from benchmarks.lib.long_context_model import context_label, decode_floor

ENGINE_ORDER = ("ours", "vllm", "sglang")


def new_report(config: dict[str, Any]) -> dict[str, Any]:
    return {"config": config, "runs": [], "engines": {}, "bandwidth": None, "floor": {}, "rows": [], "errors": {}}


def load_report(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def add_engine_result(report: dict[str, Any], engine: str, result: dict[str, Any], log: str,
                      error: str | None, setting: dict[str, Any] | None = None) -> None:
    """One engine process's result: its run (startup, settings, and ``setting``: what this call
    started it with) and its contexts, which replace that engine's earlier results at the same contexts."""
    run = {key: result.get(key) for key in ("startup_s", "warmup_s", "settings", "python")}
    run.update({**(setting or {}), "engine": engine, "log": log, "error": error or result.get("error")})
    report["runs"].append(run)
    entry = report["engines"].setdefault(engine, {"contexts": {}})
    for context, measured in result.get("contexts", {}).items():
        entry["contexts"][context] = {**measured, "run": len(report["runs"]) - 1}
    if run["error"]:
        report["errors"][engine] = run["error"]
    else:
        report["errors"].pop(engine, None)


def _measured(report: dict[str, Any], engine: str, context: str) -> dict[str, Any] | None:
    entry = report["engines"].get(engine, {}).get("contexts", {}).get(context)
    return entry if entry is not None and "error" not in entry else None


def _ratio(ours: float | None, peers: list[float]) -> float | None:
    return ours / min(peers) if ours is not None and peers else None


def build_rows(report: dict[str, Any], shape: ModelShape, bandwidth: float | None, tensor_parallel_size: int,
               kv_cache_dtype: str, batch: int = 1) -> None:
    """``report["floor"]`` and ``report["rows"]``: per context and engine, TTFT, decode, % of the
    floor; on our row, ours / the best peer. ``batch``: sequences decoding at once, whose KV a step
    reads (the floor's context tokens are theirs together)."""
    contexts = sorted({int(c) for e in report["engines"].values() for c in e["contexts"]})
    engines = [e for e in ENGINE_ORDER if e in report["engines"]] + sorted(set(report["engines"]) - set(ENGINE_ORDER))
    report["floor"], report["rows"] = {}, []
    for context in contexts:
        key = str(context)
        floor = None
        measured = {engine: _measured(report, engine, key) for engine in engines}
        shaped = next((m for m in measured.values() if m is not None), None)
        if bandwidth is not None and shaped is not None:
            mean_context = shaped["prompt_len"] + shaped["output_len"] / 2
            floor = decode_floor(shape, mean_context * batch, bandwidth, tensor_parallel_size, kv_cache_dtype)
            report["floor"][key] = floor.to_dict()
        peers = [m for engine, m in measured.items() if engine != "ours" and m is not None]
        for engine in engines:
            m = measured[engine]
            row: dict[str, Any] = {"context": context, "engine": engine, "ttft_ms": None, "decode_ms_per_token": None,
                                   "floor_ms_per_token": floor.ms_per_token if floor else None,
                                   "percent_of_floor": None, "ttft_ratio": None, "decode_ratio": None}
            if m is None:
                raw = report["engines"][engine]["contexts"].get(key)
                row["error"] = raw["error"] if raw is not None else "not measured"
            else:
                row.update(ttft_ms=m["ttft_ms"], decode_ms_per_token=m["decode_ms_per_token"],
                           repeats=m["repeats"], complete=m["complete"])
                if "probe" in m:  # the first chunks of the context's prefill: TTFT and decode at their length
                    row.update(probe_tokens=m["probe"]["prompt_tokens"], prefill_tok_s=m["probe"]["prefill_tok_s"],
                               admission=m["admission"])
                if floor is not None and m["decode_ms_per_token"]:
                    row["percent_of_floor"] = 100 * floor.ms_per_token / m["decode_ms_per_token"]
                if engine == "ours":
                    row["ttft_ratio"] = _ratio(m["ttft_ms"], [p["ttft_ms"] for p in peers])
                    row["decode_ratio"] = _ratio(m["decode_ms_per_token"],
                                                 [p["decode_ms_per_token"] for p in peers if p["decode_ms_per_token"]])
            report["rows"].append(row)


def _number(value: float | None, digits: int) -> str:
    """``digits`` decimals; three significant digits for values too small for them (tiny models)."""
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if abs(value) >= 10 ** (1 - digits) or value == 0 else f"{value:.3g}"


def format_markdown(report: dict[str, Any]) -> str:
    config, bandwidth = report["config"], report.get("bandwidth") or {}
    batch = config.get("batch") or 1
    lines = [
        f"Long contexts: {config.get('model_description')}, TP={config.get('tensor_parallel_size')}, "
        f"KV cache {config.get('kv_cache_dtype')}, {config.get('output_len')} output tokens, "
        + (f"{batch} requests at once." if batch > 1 else "one request at a time."),
        ("TTFT: median of the batch's first tokens; decode: ms a step while all of them decode (each step a token "
         "of each); floor: (weights + their KV, per GPU) / the copy bandwidth" if batch > 1 else
         "TTFT: median time to the first token of a fresh prompt; decode: median (last - first token) / (tokens - 1); "
         "floor: (weights + the context's KV, per GPU) / the copy bandwidth")
        + (f" ({bandwidth['bytes_per_s'] / 1e12:.2f} TB/s, {bandwidth['source']})." if bandwidth else " (not known)."),
        "",
        "| context | engine | TTFT (ms) | decode (ms/token) | floor (ms/token) | % of floor | TTFT ours/best peer "
        "| decode ours/best peer |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    previous = None
    for row in report["rows"]:
        name = context_label(row["context"])
        label = name if name == str(row["context"]) else f"{name} ({row['context']:,})"
        label = label if row["context"] != previous else ""
        previous = row["context"]
        if "error" in row:
            lines.append(f"| {label} | {row['engine']} | {row['error'][:60]} | | | | | |")
            continue
        percent = row["percent_of_floor"]
        lines.append(
            f"| {label} | {row['engine']} | {_number(row['ttft_ms'], 1)} | {_number(row['decode_ms_per_token'], 3)} "
            f"| {_number(row['floor_ms_per_token'], 3)} | {'-' if percent is None else _number(percent, 1) + '%'} "
            f"| {_number(row['ttft_ratio'], 2)} | {_number(row['decode_ratio'], 2)} |"
        )
    probes = [row for row in report["rows"] if "probe_tokens" in row]
    lines += [""] if probes else []
    for row in probes:
        if True:
            admission = row["admission"]
            admitted = ("admitted" if admission.get("admitted") else "refused") if admission.get("checked") \
                else "not offered"
            lines.append(f"- {context_label(row['context'])}, {row['engine']}: its {admission['prompt_len']:,}-token "
                         f"prompt {admitted}; TTFT and decode above of prompts of its first "
                         f"{row['probe_tokens']:,} tokens, prefill {row['prefill_tok_s']:,.0f} tokens/s")
    startups = [f"{run['engine']} {run['startup_s']:.1f} s" for run in report["runs"] if run.get("startup_s")]
    if startups:
        lines += ["", "Engine startup: " + ", ".join(startups) + "."]
    for engine, error in report["errors"].items():
        lines.append(f"{engine} failed: {error}")
    for context, measured in sorted(report["engines"].get("ours", {}).get("contexts", {}).items(),
                                    key=lambda item: int(item[0])):
        if measured.get("trace") is not None:
            lines += chunk_markdown(context_label(int(context)), measured["trace"])
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "long_context.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out_dir / "long_context.md").write_text(format_markdown(report))
