"""The table of one prefill's chunks through the pipeline's stages (sequence pipeline parallelism),
from the metrics store's events: ``benchmarks/long_context.py --trace``'s part of the report.

Per chunk (PREFILL_CHUNK, in order): its step, first position and tokens, and per stage the step
as that stage's first worker reported it (STEP_FINISHED; only TP rank 0 reports): its start (the
event's time less ``execute_ms``) and end (the event's time), in ms from the request's arrival, its
``execute_ms``, and the idle gap on that stage since the previous chunk's step ended there (none
before the first chunk or after a step not reported; negative where steps overlap). Per stage: its
bubble fraction over the prefill's window (the metrics store's own reckoning,
bubbles.PipelineBubbles, fed these steps alone), its busy time and the sum of its gaps. For C
chunks over P stages, back-to-back chunks take (C+P-1)/(C*P) of one stage's time at best
(``ideal_time_ratio``), a bubble fraction of (P-1)/(C+P-1) on every stage
(``ideal_bubble_fraction``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vllm_actors.actors.metrics_store.bubbles import PipelineBubbles
from vllm_actors.observe.trace import TraceRow
from vllm_actors.protocol.events import Arrived, FirstToken, PrefillChunk, Queued, Scheduled, StepFinished

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
    reported: dict[int, dict[int, dict[str, tuple[float, StepFinished]]]] = {}  # stage -> step -> actor -> step
    for actor, _, _, wall, event in rows:
        if isinstance(event, StepFinished) and event.step_id in step_ids:
            stage = num_stages - 1 if event.stage is None else event.stage
            reported.setdefault(stage, {}).setdefault(event.step_id, {})[actor] = (wall, event)
    workers = {stage: min((actor for by_actor in steps.values() for actor in by_actor), key=_rank)
               for stage, steps in reported.items()}

    bubbles = PipelineBubbles()
    table_rows: list[dict[str, Any]] = []
    previous_end: dict[int, float] = {}
    gaps: dict[int, float] = dict.fromkeys(range(num_stages), 0.0)
    busy: dict[int, float] = dict.fromkeys(range(num_stages), 0.0)
    for index, chunk in enumerate(chunks):
        per_stage: list[dict[str, Any] | None] = []
        for stage in range(num_stages):
            found = reported.get(stage, {}).get(chunk.step_id, {}).get(workers.get(stage, ""))
            if found is None:  # not reported (lost): no gap measured across it either
                per_stage.append(None)
                previous_end.pop(stage, None)
                continue
            wall, event = found
            bubbles.step(workers[stage], wall, event)
            start, end = wall - max(event.execute_ms, 0.0) / 1e3 - arrival, wall - arrival
            gap = start - previous_end[stage] if index and stage in previous_end else None
            previous_end[stage] = end
            gaps[stage] += gap or 0.0
            busy[stage] += max(event.execute_ms, 0.0)
            per_stage.append({"start_ms": _ms(start), "end_ms": _ms(end), "execute_ms": round(event.execute_ms, 3),
                              "gap_ms": None if gap is None else _ms(gap)})
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
        "stages": [{"stage": stage, "worker": workers.get(stage), "steps": sum(
                        1 for row in table_rows if row["stages"][stage] is not None),
                    "busy_ms": round(busy[stage], 3), "gap_ms": _ms(gaps[stage]),
                    "bubble_fraction": fractions.get(f"stage {stage}")} for stage in range(num_stages)],
        "chunks": table_rows,
    }


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


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
                 f"trace {record.get('file', '-')}."]
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
            cells += ["-"] * 4 if step is None else [_cell(step[key]) for key in ("start_ms", "end_ms",
                                                                                "execute_ms", "gap_ms")]
        lines.append(f"| {row['chunk']} | {row['tokens']:,} | " + " | ".join(cells) + " |")
    return lines
