"""``vllm-actors bench serve``: the mixed workload's options, one server per scheduling policy,
SLO attainment per class and policy (table, plot), and the traces of the runs.

``--workload mixed`` sends serve_mixed.py's interactive + batch requests in bursts at each of
``--rates``; ``--scheduling-policies fcfs priority edf lrs`` starts our server once per policy
(``--scheduling-policy P``), one after the other, on the same requests. ``--trace PATH`` writes
the metrics store's event log of each of our servers (taken after its last load) as a Chrome
trace: ``PATH`` itself with one server, else ``PATH`` with ``-<policy>`` (or ``-<engine>``)
before its suffix; ``--trace-policies`` picks the policies traced."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_actors.bench.serve_client import RequestResult
from vllm_actors.bench.serve_mixed import (
    BATCH,
    INTERACTIVE,
    MixedRequest,
    MixedWorkload,
    RequestClass,
    attainment,
    mixed_requests,
)
from vllm_actors.observe.trace_file import add_trace_arguments, retention_env

ATTAINMENT_GOAL = 0.8  # the sweep looks for the first rate where FCFS meets fewer interactive deadlines


def add_mixed_arguments(parser: argparse.ArgumentParser) -> None:
    mixed = parser.add_argument_group("mixed workload and policies")
    mixed.add_argument("--workload", choices=("poisson", "mixed"), default="poisson",
                       help="mixed: interactive and batch requests in bursts, SLO attainment per class (rates only)")
    mixed.add_argument("--scheduling-policies", nargs="+", default=None, metavar="POLICY",
                       help="start our server once per policy (--scheduling-policy POLICY), e.g. fcfs priority edf lrs")
    mixed.add_argument("--interactive-share", type=float, default=0.8, help="share of arrivals that are interactive")
    for klass, prefix in ((INTERACTIVE, "interactive"), (BATCH, "batch")):
        mixed.add_argument(f"--{prefix}-input-len", type=int, nargs=2, default=list(klass.input_range),
                           metavar=("MIN", "MAX"))
        mixed.add_argument(f"--{prefix}-output-len", type=int, nargs=2, default=list(klass.output_range),
                           metavar=("MIN", "MAX"))
        mixed.add_argument(f"--{prefix}-ttft-ms", type=_optional_float, default=klass.ttft_ms,
                           help="TTFT target, sent as ttft_target_ms ('none': no target)")
        mixed.add_argument(f"--{prefix}-itl-ms", type=_optional_float, default=klass.itl_ms,
                           help="bound on each request's p99 inter-token gap (judged, not sent)")
        mixed.add_argument(f"--{prefix}-e2e-ms", type=_optional_float, default=klass.e2e_ms,
                           help="end-to-end target, sent as e2e_target_ms (default for interactive: the TTFT "
                                "target + max_tokens x the gap bound)")
        mixed.add_argument(f"--{prefix}-priority", type=_optional_int, default=klass.priority,
                           help="sent as priority (lower runs first; 'none': not sent)")
    mixed.add_argument("--burst-factor", type=float, default=3.0, help="arrival rate in a burst, times the mean")
    mixed.add_argument("--burst-on-s", type=float, default=2.0)
    mixed.add_argument("--burst-off-s", type=float, default=6.0)
    mixed.add_argument("--no-request-fields", action="store_true",
                       help="send neither priority nor targets (servers without them)")
    trace = parser.add_argument_group("trace")
    add_trace_arguments(trace, "our servers' event logs (taken after their last load)")
    trace.add_argument("--trace-policies", nargs="+", default=None, metavar="POLICY",
                       help="trace only the runs of these policies (default: every run)")


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def check_arguments(args: argparse.Namespace) -> None:
    if args.workload == "mixed" and args.concurrencies:
        raise ValueError("--workload mixed takes --rates, not --concurrencies")
    if args.scheduling_policies and args.url:
        raise ValueError("--scheduling-policies starts servers: not with --url")
    if args.workload == "mixed":
        workload(args, 1.0, 0).rates()  # raises on a burst shape that cannot keep the mean


def classes(args: argparse.Namespace) -> tuple[RequestClass, RequestClass]:
    made = []
    for name in ("interactive", "batch"):
        made.append(RequestClass(
            name, tuple(getattr(args, f"{name}_input_len")), tuple(getattr(args, f"{name}_output_len")),  # type: ignore[arg-type]
            ttft_ms=getattr(args, f"{name}_ttft_ms"), itl_ms=getattr(args, f"{name}_itl_ms"),
            e2e_ms=getattr(args, f"{name}_e2e_ms"), priority=getattr(args, f"{name}_priority"),
        ))
    return made[0], made[1]


def workload(args: argparse.Namespace, rate: float, seed: int) -> MixedWorkload:
    return MixedWorkload(rate=rate, duration=args.duration, seed=seed, interactive_share=args.interactive_share,
                         burst_factor=args.burst_factor, burst_on_s=args.burst_on_s, burst_off_s=args.burst_off_s,
                         classes=classes(args), send_fields=not args.no_request_fields)


def load_mixed(args: argparse.Namespace, rate: float, seed: int) -> list[MixedRequest]:
    return mixed_requests(workload(args, rate, seed))


def mixed_description(args: argparse.Namespace) -> str:
    """The mixed workload in one paragraph, for serve.md."""
    shape = workload(args, 1.0, 0)
    parts = []
    for klass in shape.classes:
        targets = [f"{label} <= {value:g} ms" for label, value in (("TTFT", klass.ttft_ms), ("p99 gap", klass.itl_ms),
                                                                  ("end-to-end", klass.e2e_ms)) if value is not None]
        parts.append(f"{klass.name}: prompts {klass.input_range[0]}-{klass.input_range[1]} tokens, outputs "
                     f"{klass.output_range[0]}-{klass.output_range[1]}, targets {', '.join(targets) or 'none'}, "
                     f"priority {klass.priority if klass.priority is not None else 'not sent'}")
    return (f"Mixed workload: {shape.interactive_share:.0%} interactive; bursts of {shape.burst_factor:g}x the mean "
            f"rate for {shape.burst_on_s:g} s every {shape.burst_on_s + shape.burst_off_s:g} s; {args.duration:g} s "
            f"of arrivals per load, {args.num_clients} client processes"
            + ("; no priority or targets sent" if args.no_request_fields else "") + ". " + "; ".join(parts) + ".")


def servers(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(engine, policy) per server to start: our server once per policy, then any other engine."""
    if not args.scheduling_policies:
        return [(engine, None) for engine in args.engines]
    started = [("ours", policy) for policy in args.scheduling_policies if "ours" in args.engines]
    return started + [(engine, None) for engine in args.engines if engine != "ours"]


def server_name(engine: str, policy: str | None) -> str:
    name = {"vllm": "vLLM", "sglang": "SGLang"}.get(engine, "vllm_actors")
    return f"{name} {policy}" if policy else name


def policy_arguments(policy: str | None) -> list[str]:
    return ["--scheduling-policy", policy] if policy else []


def slo_summary(args: argparse.Namespace, results: list[RequestResult], requests: list[Any],
                start: float) -> dict[str, Any]:
    return attainment(results, requests, classes(args), start)


# --------------------------------------------------------------------------- traces
def trace_path(args: argparse.Namespace, engine: str, policy: str | None, many: bool) -> Path | None:
    """Where this server's trace goes (None: not traced)."""
    if not args.trace or engine != "ours":
        return None
    if args.trace_policies and (policy or "") not in args.trace_policies:
        return None
    path = Path(args.trace)
    if not many:
        return path
    name = path.name
    suffix = ".json.gz" if name.endswith(".json.gz") else path.suffix
    return path.with_name(f"{name[:len(name) - len(suffix)] if suffix else name}-{policy or engine}{suffix}")


def trace_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of a traced server: a metrics store that keeps the whole run."""
    return retention_env(args.trace_max_events)


def save_trace(server_pid: int, path: Path, max_mb: float) -> dict[str, Any]:
    """The event log of the group ``vllm-actors serve`` (``server_pid``) runs, as a trace."""
    from functools import partial

    from vllm_actors.observe.tap import query_metrics
    from vllm_actors.observe.trace_file import group_of, max_trace_bytes, trace_from_store, trace_record
    from vllm_actors.runtime.security import GroupKeys, is_tcp

    group = group_of(server_pid)
    if group is None:
        raise RuntimeError(f"no running group of process {server_pid}")
    address = group.addresses.metrics
    keys = GroupKeys.load(group.run_dir) if is_tcp(address) else None
    written = trace_from_store(partial(query_metrics, address, timeout_ms=120_000, keys=keys), path,
                               max_trace_bytes(max_mb))
    return trace_record(written)


# --------------------------------------------------------------------------- report
SLO_HEADER = ("| server | load | interactive met (in bursts) | batch met | rejected (int. / batch) "
              "| interactive TTFT p50 / p99 (ms) | interactive gap p99, p99 of requests (ms) | batch out tok/s "
              "| vs first |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def slo_row(name: str, load: dict[str, Any], baseline: float | None) -> str:
    slo = load["slo"]
    inter, batch = slo["classes"]["interactive"], slo["classes"]["batch"]
    burst = slo["in_bursts"]["interactive"]
    ratio = f"{batch['output_tok_s'] / baseline:.2f}x" if baseline else "-"
    return (f"| {name} | {load['value']:g}/s | {inter['attainment']:.1%} of {inter['requests']} "
            f"({burst['attainment']:.1%} of {burst['requests']}) | {batch['attainment']:.1%} of {batch['requests']} "
            f"| {inter['rejected']} / {batch['rejected']} | {inter['ttft']['p50'] * 1e3:.1f} / "
            f"{inter['ttft']['p99'] * 1e3:.1f} | {inter['itl_p99']['p99'] * 1e3:.1f} | {batch['output_tok_s']:,.0f} "
            f"| {ratio} |")


def slo_markdown(records: list[dict[str, Any]]) -> list[str]:
    """The attainment table (batch throughput against the first server's at the same rate) and
    where FCFS first meets fewer than 80% of interactive deadlines."""
    mixed = [record for record in records if any("slo" in load for load in record["loads"])]
    if not mixed:
        return []
    first = {load["value"]: load["slo"]["classes"]["batch"]["output_tok_s"] for load in mixed[0]["loads"]
             if "slo" in load}
    lines = ["", "SLO attainment (share of requests sent that completed within every target of their class):", "",
             SLO_HEADER]
    lines += [slo_row(record["name"], load, first.get(load["value"])) for record in mixed
              for load in record["loads"] if "slo" in load]
    for record in mixed:
        if record.get("policy") == "fcfs":
            below = [load["value"] for load in record["loads"]
                     if "slo" in load and load["slo"]["classes"]["interactive"]["attainment"] < ATTAINMENT_GOAL]
            lines += ["", f"FCFS meets fewer than {ATTAINMENT_GOAL:.0%} of interactive deadlines from "
                      + (f"{min(below):g} req/s on." if below else "none of the rates measured.")]
    return lines


def write_slo_plot(records: list[dict[str, Any]], path: Path) -> bool:
    from vllm_actors.bench.report import load_pyplot

    mixed = [record for record in records if any("slo" in load for load in record["loads"])]
    if not mixed:
        return False
    plt = load_pyplot(path)
    if plt is None:
        print("matplotlib is not installed: no SLO plot", flush=True)
        return False
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for record in mixed:
        loads = [load for load in record["loads"] if "slo" in load]
        xs = [load["value"] for load in loads]
        for axis, name in zip(axes[:2], ("interactive", "batch"), strict=False):
            axis.plot(xs, [load["slo"]["classes"][name]["attainment"] * 100 for load in loads], marker="o",
                      label=record["name"])
            axis.set_title(f"{name}: requests within their targets (%)")
            axis.set_ylim(0, 105)
        axes[2].plot(xs, [load["slo"]["classes"]["batch"]["output_tok_s"] for load in loads], marker="o",
                     label=record["name"])
    axes[0].axhline(ATTAINMENT_GOAL * 100, color="grey", ls=":", lw=1)
    axes[2].set_title("batch output tok/s")
    for axis in axes:
        axis.set_xlabel("requests/s (mean)")
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
