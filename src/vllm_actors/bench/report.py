"""The throughput benchmark's results: their types, the printed table, ``results.json`` and
``throughput.png`` (matplotlib, imported lazily: without it the PNG is skipped with a warning).
Shared by the other runners: ``LatencyStats``, ``percentile``, ``write_json``, ``load_pyplot``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- result types
@dataclass(frozen=True)
class LatencyStats:
    """Seconds, over the samples of one run."""

    count: int = 0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    mean: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, samples: list[float]) -> LatencyStats:
        if not samples:
            return cls()
        ordered = sorted(samples)
        return cls(count=len(ordered), p50=percentile(ordered, 0.50), p90=percentile(ordered, 0.90),
                   p99=percentile(ordered, 0.99), mean=sum(ordered) / len(ordered), max=ordered[-1])


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, interpolating linearly between the nearest ranks."""
    if not ordered:
        return 0.0
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class OursResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # produced (counted from the outputs)
    expected_output_tokens: int  # the workload's max_tokens summed
    seconds: float  # wall time of llm.generate
    enforce_eager: bool

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@dataclass(frozen=True)
class IdleShare:
    """GPU idle time between consecutive decode-only steps, from the worker's STEP_FINISHED events:
    Σ max(0, Δmono - execute of the later step) / Σ Δmono."""

    share: float
    idle_s: float
    interval_s: float
    pairs: int  # consecutive decode-only step pairs counted


@dataclass(frozen=True)
class EngineMetrics:
    """From the metrics store, over the timed run."""

    idle: IdleShare | None
    ttft: LatencyStats  # ARRIVED -> FIRST_TOKEN of the run's requests
    itl: LatencyStats  # between consecutive TOKENS of each request
    decode_step_ms: LatencyStats  # execute_ms of the decode-only steps: in milliseconds, not seconds
    num_steps: int
    num_decode_steps: int
    events_in_log: int
    log_complete: bool  # False when the bounded event log had already dropped events of the run
    store_summary: dict[str, Any] = field(default_factory=dict)  # llm.get_metrics(): whole process group
    # per pipeline stage whose every step was timed on the GPU (STEP_TIMED): its GPU's busy share
    gpu_busy: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Batch1Result:
    """One request decoding alone: ms per output token = (e2e - ttft) / (n - 1)."""

    enforce_eager: bool
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    ms_per_token: float
    client_seconds: float  # wall time of llm.generate around it


@dataclass
class BenchReport:
    """Our engine's figures; a developer benchmark's subclass adds comparisons (rows, bars, keys)."""

    config: dict[str, Any]
    ours: OursResult | None = None
    metrics: EngineMetrics | None = None
    batch1: dict[str, Batch1Result] = field(default_factory=dict)  # "graphs_on" / "graphs_off"
    errors: dict[str, str] = field(default_factory=dict)  # part -> what went wrong
    total_seconds: float = 0.0
    steps: list[dict[str, float]] = field(default_factory=list)  # per worker step of the timed run
    ours_runs: list[float] = field(default_factory=list)  # output tok/s of every timed run (the best is ``ours``)
    startup_s: float | None = None  # our engine: LLM(...) until it returned

    def comparison_rows(self) -> list[tuple[str, str]]:
        """Table rows after our throughput's (what ours is compared with); none here."""
        return []

    def comparison_bars(self) -> list[tuple[str, float]]:
        """Bars beside ours in the plot (label, output tok/s); none here."""
        return []

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "ours": None if self.ours is None else self.ours.to_dict(),
            "metrics": None if self.metrics is None else asdict(self.metrics),
            "batch1": {name: asdict(result) for name, result in self.batch1.items()},
            "errors": dict(self.errors),
            "total_seconds": self.total_seconds,
            "ours_runs": self.ours_runs,
            "startup_s": self.startup_s,
            "steps": self.steps,
        }


# --------------------------------------------------------------------------- outputs
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def table_rows(report: BenchReport) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    config = report.config
    rows.append(("model", str(config.get("model_description", config.get("model", "")))))
    ours = report.ours
    if ours is not None:
        rows.append(("workload", f"{ours.num_requests} requests, {ours.prompt_tokens:,} prompt / "
                                 f"{ours.output_tokens:,} output tokens"))
        rows.append(("ours: output tok/s", f"{ours.tokens_per_s:,.0f}"))
        rows.append(("ours: wall time of generate", f"{ours.seconds:,.2f} s"))
        if len(report.ours_runs) > 1:
            rows.append(("ours: every run (tok/s)", ", ".join(f"{value:,.0f}" for value in report.ours_runs)))
    if report.startup_s is not None:
        rows.append(("ours: engine start", f"{report.startup_s:.1f} s"))
    rows.extend(report.comparison_rows())
    metrics = report.metrics
    if metrics is not None:
        if metrics.gpu_busy:
            rows.append(("GPU busy (device clock, STEP_TIMED)",
                         ", ".join(f"{actor} {share:.1%}" for actor, share in metrics.gpu_busy.items())))
        if metrics.idle is not None:
            rows.append(("GPU idle between decode steps", f"{metrics.idle.share:.1%} ({metrics.idle.idle_s:.2f} s "
                                                          f"of {metrics.idle.interval_s:.2f} s, "
                                                          f"{metrics.idle.pairs} step pairs)"))
        rows.append(("decode step execute p50 / p99", f"{metrics.decode_step_ms.p50:.2f} / "
                                                      f"{metrics.decode_step_ms.p99:.2f} ms "
                                                      f"({metrics.num_decode_steps} of {metrics.num_steps} steps)"))
        rows.append(("TTFT p50 / p99", f"{_ms(metrics.ttft.p50)} / {_ms(metrics.ttft.p99)}"))
        rows.append(("ITL p50 / p99", f"{_ms(metrics.itl.p50)} / {_ms(metrics.itl.p99)}"))
        if not metrics.log_complete:
            rows.append(("warning", "the event log had dropped events of the run: metrics are partial"))
    for key, label in (("graphs_on", "CUDA graphs on"), ("graphs_off", "CUDA graphs off (eager)")):
        result = report.batch1.get(key)
        if result is not None:
            rows.append((f"batch-1 decode, {label}", f"{result.ms_per_token:.2f} ms/token ({result.output_tokens} "
                                                     f"tokens after a {result.prompt_tokens}-token prompt, "
                                                     f"TTFT {_ms(result.ttft_s)})"))
    for part, error in report.errors.items():
        rows.append((f"error: {part}", error))
    rows.append(("total benchmark wall time", f"{report.total_seconds:,.1f} s"))
    return rows


def format_table(report: BenchReport) -> str:
    rows = table_rows(report)
    width = max(len(name) for name, _ in rows)
    lines = [f"{'metric'.ljust(width)} | value", f"{'-' * width}-+-{'-' * 40}"]
    lines.extend(f"{name.ljust(width)} | {value}" for name, value in rows)
    return "\n".join(lines)


class JsonReport(Protocol):
    """Any report that can be written as JSON (this module's ``BenchReport``, the prefix benchmark's)."""

    def to_dict(self) -> dict[str, Any]: ...


def write_json(report: JsonReport, path: Path) -> None:
    """``report.to_dict()`` as indented JSON, written to a temporary file then moved into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n")
    temporary.replace(path)


def load_pyplot(path: Path) -> Any | None:
    """matplotlib's pyplot on the Agg backend, or None (with a warning naming the plot ``path``
    that will be skipped) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: skipping the plot", path=str(path))
        return None
    return plt


def write_png(report: BenchReport, path: Path) -> bool:
    """Left: output tok/s of ours and of what it is compared with. Right: step time and batch size
    over the timed run. Returns False (with a warning) when matplotlib is missing."""
    plt = load_pyplot(path)
    if plt is None:
        return False
    bars: list[tuple[str, float]] = []
    if report.ours is not None:
        bars.append(("vllm_actors", report.ours.tokens_per_s))
    bars.extend(report.comparison_bars())

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 2]})
    if bars:
        names, values = zip(*bars, strict=True)
        drawn = left.bar(names, values, color=["tab:blue", "tab:gray", "tab:orange", "tab:purple"][: len(bars)])
        left.bar_label(drawn, labels=[f"{value:,.0f}" for value in values])
    left.set_ylabel("output tokens / s")
    left.set_title("throughput")

    steps = report.steps
    if steps:
        times = [step["t"] for step in steps]
        right.plot(times, [step["execute_ms"] for step in steps], lw=0.8, label="execute ms", color="tab:blue")
        right.plot(times, [step["interval_ms"] for step in steps], lw=0.8, label="interval ms (finish to finish)",
                   color="tab:red", alpha=0.6)
        right.set_xlabel("seconds since the run started")
        right.set_ylabel("step time (ms)")
        right.set_ylim(bottom=0)
        right.legend(loc="upper left")
        batch_axis = right.twinx()
        batch_axis.plot(times, [step["num_seqs"] for step in steps], lw=1.0, color="tab:green", label="batch size")
        batch_axis.set_ylabel("sequences in the step", color="tab:green")
        batch_axis.set_ylim(bottom=0)
    right.set_title("steps over the run (from the event log)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
