"""``vllm-actors bench serve``'s report: the per-load rows, ``serve.json``, ``serve.md`` and the plots,
and the report of several runs merged (``--merge``). ``_RECORDS`` holds the servers measured so far."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from vllm_actors.bench import serve_long
from vllm_actors.bench.serve_client import spread, tpot
from vllm_actors.bench.serve_policies import mixed_description, slo_markdown, write_slo_plot

_RECORDS: list[dict[str, Any]] = []


def _load_label(summary: dict[str, Any]) -> str:
    value = summary["value"]
    if summary["kind"] == serve_long.LONG_KIND:
        return f"{value:g}/s + {summary['long']['prompt_tokens']:,}-token request"
    return f"{value:g}/s" if summary["kind"] == "rate" else f"c={int(value)}"


HEADER = ("| server | load | sent | failed | out tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) "
          "| TPOT p50 / p99 (ms) | tokens per chunk | E2E p50 / p90 / p99 (s) | goodput (share, req/s) |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def format_row(name: str, s: dict[str, Any]) -> str:
    t, i, e, g = s["ttft"], s["itl"], s["e2e"], s["goodput"]
    return (f"| {name} | {_load_label(s)} | {s['sent']} | {s['failed']} | {s['output_tok_s']:,.0f} | "
            f"{t['p50'] * 1e3:.1f} / {t['p90'] * 1e3:.1f} / {t['p99'] * 1e3:.1f} | "
            f"{i['p50'] * 1e3:.2f} / {i['p90'] * 1e3:.2f} / {i['p99'] * 1e3:.2f} | "
            f"{s['tpot']['p50'] * 1e3:.2f} / {s['tpot']['p99'] * 1e3:.2f} | {s['tokens_per_chunk']:.2f} | "
            f"{e['p50']:.2f} / {e['p90']:.2f} / {e['p99']:.2f} | {g['share']:.1%}, {g['rate']:.2f} |")


def markdown(args: argparse.Namespace) -> str:
    lines = [f"# bench serve, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"command: `{' '.join(shlex.quote(a) for a in sys.argv)}`", "",
             f"SLO: TTFT <= {args.slo_ttft_ms:g} ms and the request's p99 inter-token gap <= {args.slo_itl_ms:g} ms; "
             f"{args.duration:g} s of arrivals per load, {args.num_clients} client processes, prompts "
             f"{args.input_len[0]}-{args.input_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]}.", ""]
    if getattr(args, "workload", "poisson") == "mixed":  # (a merged older run has no workload)
        lines[4:6] = [mixed_description(args), ""]
    for record in _RECORDS:
        lines.append(f"- {record['name']}: {record.get('version', '')} startup {record.get('startup_s', 0):.1f} s"
                     + (f", error: {record['error']}" if record.get("error") else "")
                     + (f" (from {record['source']})" if record.get("source") else "")
                     + (f"; server: `{record['command']}`" if record.get("command") else "")
                     + (f"; resolved: {record['settings']}" if record.get("settings") else ""))
    lines += ["", HEADER]
    lines += [format_row(record["name"], summary) for record in _RECORDS for summary in record["loads"]]
    longs = [serve_long.describe(record["name"], summary) for record in _RECORDS for summary in record["loads"]
             if "long" in summary]
    if longs:
        lines += ["", *(f"- {line}" for line in longs)]
    lines += slo_markdown(_RECORDS)
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, args: argparse.Namespace, plot: bool | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    document = {"config": {k: v for k, v in vars(args).items()}, "servers": _RECORDS}
    temporary = out / "serve.json.tmp"
    temporary.write_text(json.dumps(document, indent=1) + "\n")
    temporary.replace(out / "serve.json")
    (out / "serve.md").write_text(markdown(args))
    if plot:
        write_plot(out / "serve.png")
        write_slo_plot(_RECORDS, out / "slo.png")


def write_plot(path: Path) -> bool:
    from vllm_actors.bench.report import load_pyplot

    plt = load_pyplot(path)
    if plt is None:
        print("matplotlib is not installed: no plot", flush=True)
        return False
    panels = (("TTFT p50 / p99 (ms)", "ttft", 1e3), ("inter-token p50 / p99 (ms)", "itl", 1e3),
              ("end-to-end p50 / p99 (s)", "e2e", 1.0))
    figure, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for record in _RECORDS:
        if not record["loads"]:
            continue
        xs = [summary["value"] for summary in record["loads"]]
        for axis, (title, key, scale) in zip(axes, panels, strict=False):
            line = axis.plot(xs, [s[key]["p50"] * scale for s in record["loads"]], marker="o",
                             label=f"{record['name']} p50")
            axis.plot(xs, [s[key]["p99"] * scale for s in record["loads"]], marker="x", ls="--",
                      color=line[0].get_color(), label=f"{record['name']} p99")
            axis.set_title(title)
        axes[3].plot(xs, [s["goodput"]["share"] * 100 for s in record["loads"]], marker="o", label=record["name"])
    axes[3].set_title("goodput under the SLO (% of requests)")
    axes[3].set_ylim(0, 105)
    for axis in axes:
        axis.set_xlabel("requests/s" if not _RECORDS or not _RECORDS[0]["loads"]
                        or _RECORDS[0]["loads"][0]["kind"] == "rate" else "concurrency")
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# --------------------------------------------------------------------------- merged runs
def _without_rows(load: dict[str, Any]) -> dict[str, Any]:
    """A load's summary without its per-request rows, with TPOT computed from them where a run
    older than the TPOT column lacks it."""
    rows = load.get("per_request") or []
    if "tpot" not in load and rows:
        done = [row for row in rows if row["ok"]]
        load = {**load, "tpot": spread([t for r in done if (t := tpot(r["ttft"], r["e2e"], r["out"])) is not None])}
        gaps = load["itl"]["count"]
        load["tokens_per_chunk"] = load["output_tokens"] / max(1, gaps + len(done))
    return {k: v for k, v in load.items() if k != "per_request"}


def merge(paths: list[str], out: Path) -> int:
    """The servers of several runs in one report; the settings (SLO, lengths, ...) are the first run's."""
    documents = [json.loads(Path(path).read_text()) for path in paths]
    args = argparse.Namespace(**{**documents[0]["config"], "merge": paths, "out": str(out)})
    _RECORDS.clear()
    for path, document in zip(paths, documents, strict=True):
        for record in document["servers"]:
            record = {**record, "source": Path(path).name}
            record["loads"] = [_without_rows(load) for load in record["loads"]]
            _RECORDS.append(record)
    write_outputs(out, args, True)
    print(markdown(args), flush=True)
    return 0
