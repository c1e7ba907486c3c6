"""``vllm-actors bench prefix``: the report - on/off ratios, the text tables, the JSON record and
the plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_actors.bench.prefix_run import RunResult
from vllm_actors.bench.report import load_pyplot


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def compare(on: RunResult, off: RunResult) -> dict[str, float | None]:
    """TTFT off / on (above 1: caching helps) and throughput on / off (above 1: caching helps)."""
    return {
        "ttft_p50_off_over_on": _ratio(off.ttft.p50, on.ttft.p50),
        "ttft_p99_off_over_on": _ratio(off.ttft.p99, on.ttft.p99),
        "ttft_mean_off_over_on": _ratio(off.ttft.mean, on.ttft.mean),
        "output_tokens_per_s_on_over_off": _ratio(on.output_tokens_per_s, off.output_tokens_per_s),
        "total_tokens_per_s_on_over_off": _ratio(on.total_tokens_per_s, off.total_tokens_per_s),
    }


def caching_key(prefix_caching: bool) -> str:
    return "on" if prefix_caching else "off"


@dataclass
class PrefixReport:
    config: dict[str, Any]
    runs: dict[str, dict[str, RunResult]] = field(default_factory=dict)  # workload -> "on" / "off" -> result
    errors: dict[str, str] = field(default_factory=dict)  # "workload/on" -> what went wrong
    total_seconds: float = 0.0

    def add(self, result: RunResult) -> None:
        self.runs.setdefault(result.workload, {})[caching_key(result.prefix_caching)] = result

    def ratios(self, workload: str) -> dict[str, float | None] | None:
        runs = self.runs.get(workload, {})
        if "on" not in runs or "off" not in runs:
            return None
        return compare(runs["on"], runs["off"])

    def to_dict(self) -> dict[str, Any]:
        workloads = {
            name: {"on": runs["on"].to_dict() if "on" in runs else None,
                   "off": runs["off"].to_dict() if "off" in runs else None,
                   "ratios": self.ratios(name)}
            for name, runs in self.runs.items()
        }
        return {"config": self.config, "workloads": workloads, "errors": dict(self.errors),
                "total_seconds": self.total_seconds}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return " | ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                          for column, (cell, width) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(header), "-+-".join("-" * width for width in widths), *(line(row) for row in rows)])


RUN_HEADER = ("workload", "caching", "done", "prompt tok", "computed", "output tok", "wall", "steps", "ms/step",
              "output tok/s", "total tok/s", "TTFT mean", "TTFT p50", "TTFT p99", "hit rate")
RATIO_HEADER = ("workload", "TTFT p50 off/on", "TTFT p99 off/on", "TTFT mean off/on", "output tok/s on/off",
                "total tok/s on/off")


def run_row(result: RunResult) -> list[str]:
    hit_rate = "n/a" if result.hit_rate is None else f"{result.hit_rate:.1%}"
    return [result.workload, caching_key(result.prefix_caching), f"{result.completed}/{result.num_requests}",
            f"{result.prompt_tokens:,}", f"{result.prefill_tokens_computed:,}", f"{result.output_tokens:,}",
            f"{result.seconds:,.2f} s", f"{result.steps:,}",
            f"{result.seconds / result.steps * 1e3:.1f}" if result.steps else "n/a",
            f"{result.output_tokens_per_s:,.0f}", f"{result.total_tokens_per_s:,.0f}", _ms(result.ttft.mean),
            _ms(result.ttft.p50), _ms(result.ttft.p99), hit_rate]


def format_report(report: PrefixReport) -> str:
    runs = [result for runs in report.runs.values() for result in runs.values()]
    parts = [f"model: {report.config.get('model_description', report.config.get('model', ''))}"]
    if runs:
        parts.append(format_columns(RUN_HEADER, [run_row(result) for result in runs]))
    ratios = [(name, report.ratios(name)) for name in report.runs]
    ratio_rows = [[name, _times(r["ttft_p50_off_over_on"]), _times(r["ttft_p99_off_over_on"]),
                   _times(r["ttft_mean_off_over_on"]), _times(r["output_tokens_per_s_on_over_off"]),
                   _times(r["total_tokens_per_s_on_over_off"])] for name, r in ratios if r is not None]
    if ratio_rows:
        parts.append(format_columns(RATIO_HEADER, ratio_rows))
    parts.extend(f"error: {part}: {error}" for part, error in report.errors.items())
    parts.append(f"total benchmark wall time: {report.total_seconds:,.1f} s")
    return "\n\n".join(parts)


COLORS = {"on": "tab:blue", "off": "tab:gray"}
THROUGHPUT_BARS = (("output tok/s", "output_tokens_per_s", "output_tokens_per_s_on_over_off"),
                   ("total tok/s", "total_tokens_per_s", "total_tokens_per_s_on_over_off"))


def write_png(report: PrefixReport, path: Path) -> bool:
    """Per workload: the TTFT CDF on top, output and total tokens/s below, caching on vs off.
    Returns False (with a warning) when matplotlib is missing; False when nothing was measured."""
    if not report.runs:
        return False
    plt = load_pyplot(path)
    if plt is None:
        return False
    names = list(report.runs)
    figure = plt.figure(figsize=(6.5 * len(names), 8.5))
    grid = figure.add_gridspec(2, 2 * len(names))
    for column, name in enumerate(names):
        runs, ratios = report.runs[name], report.ratios(name) or {}
        _plot_ttft_cdf(figure.add_subplot(grid[0, 2 * column:2 * column + 2]), name, runs)
        for offset, (label, attribute, ratio_key) in enumerate(THROUGHPUT_BARS):
            title = f"{name}: {label}, on/off {_times(ratios.get(ratio_key))}"
            _plot_bars(figure.add_subplot(grid[1, 2 * column + offset]), title, runs, attribute)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def _plot_ttft_cdf(axis: Any, name: str, runs: dict[str, RunResult]) -> None:
    for key, result in runs.items():
        samples = [seconds * 1e3 for seconds in result.ttft_samples]
        if not samples:
            continue
        fractions = [0.0] + [(index + 1) / len(samples) for index in range(len(samples))]
        hit_rate = "" if result.hit_rate is None else f", hit rate {result.hit_rate:.0%}"
        axis.step([samples[0], *samples], fractions, where="post", color=COLORS[key],
                  label=f"caching {key}: p50 {_ms(result.ttft.p50)}, p99 {_ms(result.ttft.p99)}{hit_rate}")
    axis.set_xlabel("TTFT (ms, client side: submit to first token)")
    axis.set_ylabel("fraction of requests")
    axis.set_xlim(left=0)
    axis.set_ylim(0, 1.02)
    axis.set_title(f"{name}: TTFT CDF")
    axis.legend(loc="lower right")


def _plot_bars(axis: Any, title: str, runs: dict[str, RunResult], attribute: str) -> None:
    keys = [key for key in ("on", "off") if key in runs]
    values = [getattr(runs[key], attribute) for key in keys]
    drawn = axis.bar([f"caching {key}" for key in keys], values, color=[COLORS[key] for key in keys])
    axis.bar_label(drawn, labels=[f"{value:,.0f}" for value in values])
    axis.set_ylim(0, max(values, default=0.0) * 1.15 or 1.0)
    axis.set_ylabel("tokens / s")
    axis.set_title(title)
