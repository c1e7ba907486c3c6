"""The table of one prefill's chunks through the pipeline's stages (sequence pipeline parallelism),
from the metrics store's events: ``benchmarks/long_context.py --trace``'s part of the report.

Per chunk (PREFILL_CHUNK, in order): its step, first position and tokens, and per stage the step
as that stage's first worker reported it (only TP rank 0 reports): its start and end in ms from the
request's arrival, its execution time, and the idle gap on that stage since the previous chunk's step
ended there (none before the first chunk or after a step not reported; negative where steps
overlap). Where the worker timed the step on the GPU (STEP_TIMED: on a CUDA device, every step that
samples nothing) those are the GPU's (``gpu_start``, ``gpu_end``, ``gpu_ms``: basis "gpu"); else the
host's (STEP_FINISHED: its time less ``execute_ms``, its time, ``execute_ms``: basis "host"; launch
to read-back, which for a step that samples nothing on a GPU is its launch alone). Per stage: its
bubble fraction over the prefill's window (the metrics store's own reckoning,
bubbles.PipelineBubbles, fed these steps alone, on the same basis), its busy time and the sum of its gaps. For C
chunks over P stages, back-to-back chunks take (C+P-1)/(C*P) of one stage's time at best
(``ideal_time_ratio``), a bubble fraction of (P-1)/(C+P-1) on every stage
(``ideal_bubble_fraction``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vllm_actors.actors.metrics_store.bubbles import PipelineBubbles
from vllm_actors.observe.trace import TraceRow
from vllm_actors.protocol.events import Arrived, FirstToken, PrefillChunk, Queued, Scheduled, StepFinished, StepTimed

MARKDOWN_ROWS = 64  # chunks shown in the markdown table (the first and the last ones); the JSON has all


def _rank(actor: str) -> tuple[int, str]:
    """Workers by rank ("worker-10" after "worker-2"): a stage's first worker is its lowest rank."""
    found = re.search(r"(\d+)", actor)
    return (int(found.group(1)) if found else 0, actor)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def chunk_table(rows: Sequence[TraceRow], request_id: str, num_stages: int) -> dict[str, Any]:
    """The chunk table of ``request_id``'s prefill over ``num_stages`` stages, from the store's rows."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    arrival = next((wall for _, _, _, wall, event in rows if isinstance(event, Arrived)
                    and event.request_id == request_id), None)
    if arrival is None:  # ARRIVED is the client's: QUEUED is the scheduler's first word of it
        arrival = next((wall for _, _, _, wall, event in rows if isinstance(event, Queued)
                        and event.request_id == request_id), None)
    if arrival is None:
        raise ValueError(f"no ARRIVED or QUEUED event of request {request_id!r} among {len(rows)} events")
    chunks = [event for _, _, _, _, event in rows if isinstance(event, PrefillChunk) and event.request_id == request_id]
    prompt = next((event.num_prompt_tokens for *_, event in rows
                   if isinstance(event, Arrived) and event.request_id == request_id), None)
    cached = next((event.num_cached_tokens for *_, event in rows
                   if isinstance(event, Scheduled) and event.request_id == request_id), None)
    first_token = next((wall for *_, wall, event in rows
                        if isinstance(event, FirstToken) and event.request_id == request_id), None)

    step_ids = {chunk.step_id for chunk in chunks}
    # stage -> step -> actor -> its step as busy (start, end, execute ms; wall clock) and the basis
    reported: dict[int, dict[int, dict[str, tuple[float, float, float, str]]]] = {}
    for actor, _, _, wall, event in rows:
        if isinstance(event, StepFinished) and event.step_id in step_ids:
            stage = num_stages - 1 if event.stage is None else event.stage
            seconds = max(event.execute_ms, 0.0) / 1e3
            reported.setdefault(stage, {}).setdefault(event.step_id, {})[actor] = (
                wall - seconds, wall, event.execute_ms, "host")
    for actor, _, _, _, event in rows:  # the GPU's time, where the worker measured it, replaces the host's
        if isinstance(event, StepTimed) and event.step_id in step_ids:
            stage = num_stages - 1 if event.stage is None else event.stage
            reported.setdefault(stage, {}).setdefault(event.step_id, {})[actor] = (
                event.gpu_start, event.gpu_end, event.gpu_ms, "gpu")
    workers = {stage: min((actor for by_actor in steps.values() for actor in by_actor), key=_rank)
               for stage, steps in reported.items()}

    bubbles = PipelineBubbles()
    table_rows: list[dict[str, Any]] = []
    previous_end: dict[int, float] = {}
    gaps: dict[int, float] = dict.fromkeys(range(num_stages), 0.0)
    busy: dict[int, float] = dict.fromkeys(range(num_stages), 0.0)
    bases = {"gpu": 0, "host": 0}  # stage steps timed on each basis
    for index, chunk in enumerate(chunks):
        per_stage: list[dict[str, Any] | None] = []
        for stage in range(num_stages):
            found = reported.get(stage, {}).get(chunk.step_id, {}).get(workers.get(stage, ""))
            if found is None:  # not reported (lost): no gap measured across it either
                per_stage.append(None)
                previous_end.pop(stage, None)
                continue
            begin, finish, execute_ms, basis = found
            bases[basis] += 1
            bubbles.step(workers[stage], finish, StepFinished(  # busy from finish less execute_ms
                step_id=chunk.step_id, num_seqs=0, num_tokens=0, num_sampled=0, execute_ms=(finish - begin) * 1e3,
                stage=None if stage == num_stages - 1 else stage))
            start, end = begin - arrival, finish - arrival
            gap = start - previous_end[stage] if index and stage in previous_end else None
            previous_end[stage] = end
            gaps[stage] += gap or 0.0
            busy[stage] += max(execute_ms, 0.0)
            per_stage.append({"start_ms": _ms(start), "end_ms": _ms(end), "execute_ms": round(execute_ms, 3),
                              "gap_ms": None if gap is None else _ms(gap), "basis": basis})
        table_rows.append({"chunk": index, "step_id": chunk.step_id, "start": chunk.start,
                           "tokens": chunk.num_tokens, "stages": per_stage})

    fractions = bubbles.fractions(single_stage=True)
    count = len(chunks)
    first = next((row["stages"][0] for row in table_rows if row["stages"][0] is not None), None)
    last = next((row["stages"][-1] for row in reversed(table_rows) if row["stages"][-1] is not None), None)
    return {
        "request_id": request_id, "arrival_wall": arrival, "num_stages": num_stages, "num_chunks": count,
        "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": sum(c.num_tokens for c in chunks),
        "first_token_ms": None if first_token is None else _ms(first_token - arrival),
        "prefill_ms": round(last["end_ms"] - first["start_ms"], 3) if first and last else None,
        "ideal_time_ratio": (count + num_stages - 1) / (count * num_stages) if count else None,
        "ideal_bubble_fraction": (num_stages - 1) / (count + num_stages - 1) if count else None,
        "basis": bases,
        "stages": [{"stage": stage, "worker": workers.get(stage), "steps": sum(
                        1 for row in table_rows if row["stages"][stage] is not None),
                    "busy_ms": round(busy[stage], 3), "gap_ms": _ms(gaps[stage]),
                    "bubble_fraction": fractions.get(f"stage {stage}")} for stage in range(num_stages)],
        "chunks": table_rows,
    }


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _basis(counts: dict[str, int] | None) -> str:
    """What the table's times are: the GPU's, the host's, or which where both."""
    gpu, host = (counts or {}).get("gpu", 0), (counts or {}).get("host", 0)
    if not gpu:
        return "times: the host's (STEP_FINISHED, launch to read-back)"
    if not host:
        return "times: the GPU's (STEP_TIMED, CUDA events)"
    return (f"times: the GPU's (STEP_TIMED, CUDA events) for {gpu} of {gpu + host} stage steps, the host's "
            f"(STEP_FINISHED, launch to read-back) for the rest, their exec marked *")


def chunk_markdown(label: str, record: dict[str, Any]) -> list[str]:
    """The markdown of one context's traced prefill (``record``: what the benchmark keeps of it)."""
    if "error" in record:
        return ["", f"SPP chunks at {label}: not traced ({record['error']})."]
    table = record["chunks"]
    stages, count = table["num_stages"], table["num_chunks"]
    ideal = table["ideal_time_ratio"]
    lines = ["", f"SPP chunks at {label} (request {table['request_id']}, the first measured sample): {count} chunks "
                 f"of {table['computed_tokens']:,} computed tokens over {stages} stage(s); ideal (C+P-1)/(C*P) = "
                 f"{_cell(ideal)}, ideal bubble fraction {_cell(table['ideal_bubble_fraction'])}; prefill "
                 f"{_cell(table['prefill_ms'])} ms, first token at {_cell(table['first_token_ms'])} ms; "
                 f"{_basis(table.get('basis'))}; trace {record.get('file', '-')}."]
    mixed = all((table.get("basis") or {}).get(basis, 0) for basis in ("gpu", "host"))
    for stage in table["stages"]:
        fraction = stage["bubble_fraction"]
        lines.append(f"- stage {stage['stage']} ({stage['worker'] or 'no steps'}): bubble fraction "
                     f"{'-' if fraction is None else f'{100 * fraction:.1f}%'}, busy {_cell(stage['busy_ms'])} ms, "
                     f"gaps {_cell(stage['gap_ms'])} ms over {stage['steps']} steps")
    columns = [f"s{stage} {name}" for stage in range(stages) for name in ("start", "end", "exec", "gap")]
    lines += ["", "| chunk | tokens | " + " | ".join(columns) + " |",
              "| ---: | ---: | " + " | ".join("---:" for _ in columns) + " |"]
    shown = table["chunks"]
    if len(shown) > MARKDOWN_ROWS:
        head = MARKDOWN_ROWS * 3 // 4
        shown = [*shown[:head], None, *shown[head - MARKDOWN_ROWS:]]
    for row in shown:
        if row is None:
            lines.append(f"| ... | {count - MARKDOWN_ROWS} chunks more in long_context.json | "
                         + " | ".join("" for _ in columns) + " |")
            continue
        cells = []
        for step in row["stages"]:
            if step is None:
                cells += ["-"] * 4
                continue
            host = "*" if mixed and step.get("basis") == "host" else ""
            cells += [_cell(step["start_ms"]), _cell(step["end_ms"]), _cell(step["execute_ms"]) + host,
                      _cell(step["gap_ms"])]
        lines.append(f"| {row['chunk']} | {row['tokens']:,} | " + " | ".join(cells) + " |")
    return lines
