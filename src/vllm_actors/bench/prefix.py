"""``vllm-actors bench prefix``: what prefix caching buys, caching on against caching off.

Two workloads of random token ids (drawn from seeded generators, so no tokenizer is involved),
sampled greedily with EOS ignored, so every request produces exactly ``--max-tokens`` tokens:

- ``shared``: 256 requests sharing one 2,000-token system prompt, each followed by 20-100 tokens of
  its own, all submitted at once;
- ``chat``: 64 conversations of 4 turns, 16 of them active at a time (the next one starts when one
  ends). Each turn sends the whole history (the previous turn's prompt and the tokens its reply
  generated) plus 50-150 new user tokens, as soon as the previous reply has ended.

The model has Qwen3-0.6B's shape with random weights (``load_format="dummy"``) unless ``--model``
names a checkpoint. Each workload runs twice, each time on a fresh process group driven through
``AsyncEngineClient``: prefix caching on, then off. Each run starts with a warm-up of unrelated
tokens (requests one after the other, each extending the previous one's prompt so that the path
reusing cached blocks runs too, then a burst of concurrent ones so that batched shapes have run),
then the timed part. The workloads themselves live in ``vllm_actors.bench.prefix_workloads``. Measured on the client, per request: TTFT (submit to
first token) and end-to-end time; per run: wall time, output and total (prompt + output) tokens/s,
TTFT mean / p50 / p99, and the prefix-cache hit rate, prefix_cache_hits / prefix_cache_queries
from the metrics store (the counters after the timed part minus before it; null when the store
does not report them).

Under ``--out``: ``results.json`` (rewritten after every run, so a run cut short keeps what it
measured) and ``prefix.png`` (TTFT CDF and throughput, on vs off, per workload; skipped without
matplotlib); the table goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from vllm_actors.bench.report import LatencyStats, load_pyplot, write_json
from vllm_actors.bench.throughput import add_model_arguments, write_model_dir
from vllm_actors.bench.prefix_workloads import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONVERSATIONS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_SEED,
    DEFAULT_SYSTEM_TOKENS,
    DEFAULT_TURNS,
    RequestTiming,
    WORKLOAD_NAMES,
    Workload,
    gather_all,
    make_chat_workload,
    make_shared_workload,
    random_tokens,
    timed_request,
    _rng,
)

if TYPE_CHECKING:
    from vllm_actors.clients.async_client import AsyncEngineClient

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- the warm-up
DEFAULT_WARMUP_REQUESTS = 2
WARMUP_MAX_TOKENS = 16
WARMUP_EXTENSION = 32  # tokens each warm-up prompt adds to the previous one
WARMUP_BURST = 20  # concurrent warm-up requests after the sequential ones


# --------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class StoreCounters:
    """Cumulative counters of the metrics store (the whole process group)."""

    ended: int  # requests finished or aborted
    prefix_cache_queries: int | None  # None: the store does not report prefix caching
    prefix_cache_hits: int | None
    prefill_tokens: int  # prompt tokens computed, recomputation included
    preemptions: int
    steps: int = 0  # engine steps (STEP_FINISHED events)

    @classmethod
    def of(cls, reply: Any) -> StoreCounters:
        queries = getattr(reply, "prefix_cache_queries", None)
        hits = getattr(reply, "prefix_cache_hits", None)
        return cls(
            ended=reply.requests_finished + reply.requests_aborted,
            prefix_cache_queries=None if queries is None else int(queries),
            prefix_cache_hits=None if hits is None else int(hits),
            prefill_tokens=reply.prefill_tokens, preemptions=reply.preemptions, steps=reply.steps,
        )

    def since(self, before: StoreCounters) -> StoreCounters:
        """What happened between ``before`` and this reading."""

        def delta(after: int | None, earlier: int | None) -> int | None:
            return None if after is None or earlier is None else after - earlier

        return StoreCounters(
            ended=self.ended - before.ended,
            prefix_cache_queries=delta(self.prefix_cache_queries, before.prefix_cache_queries),
            prefix_cache_hits=delta(self.prefix_cache_hits, before.prefix_cache_hits),
            prefill_tokens=self.prefill_tokens - before.prefill_tokens,
            preemptions=self.preemptions - before.preemptions,
            steps=self.steps - before.steps,
        )


async def settled_counters(client: AsyncEngineClient, expected_ended: int, timeout_s: float = 30.0) -> StoreCounters:
    """The store's counters once it has seen ``expected_ended`` requests end and two readings in a
    row agree (events travel on their own bus, each actor's separately)."""
    deadline = time.monotonic() + timeout_s
    previous: StoreCounters | None = None
    while True:
        current = StoreCounters.of(await client.get_metrics())
        caught_up = current.ended >= expected_ended
        if caught_up and current == previous:
            return current
        if time.monotonic() > deadline:
            log.warning("the metrics store has not settled", ended=current.ended, expected=expected_ended)
            return current
        previous = current if caught_up else None
        await asyncio.sleep(0.1)


async def warm_up(client: AsyncEngineClient, prompt_tokens: int, count: int, vocab_size: int, seed: int) -> int:
    """``count`` requests of tokens unrelated to the workloads, one after the other, each prompt
    the previous one plus ``WARMUP_EXTENSION`` tokens (with caching on, the later ones reuse the
    earlier's blocks). Returns how many were sent."""
    if count <= 0:
        return 0
    room = client.max_model_len - WARMUP_MAX_TOKENS - WARMUP_EXTENSION * (count - 1)
    rng = _rng(seed, "warmup")
    prompt = random_tokens(rng, max(1, min(prompt_tokens, room)), vocab_size)
    started = time.perf_counter()
    for index in range(count):
        await timed_request(client, f"warmup-{index}", prompt, WARMUP_MAX_TOKENS)
        prompt = prompt + random_tokens(rng, WARMUP_EXTENSION, vocab_size)
    # Then a burst of concurrent requests over one prefix with tails of several lengths, so that
    # batched prefill (with and without cached context) and mixed steps have run before timing.
    burst = [prompt[: max(1, len(prompt) // 2)] + random_tokens(rng, 1 + 7 * index, vocab_size)
             for index in range(WARMUP_BURST)]
    await gather_all(timed_request(client, f"warmup-burst-{index}", tokens, WARMUP_MAX_TOKENS)
                     for index, tokens in enumerate(burst))
    log.info("warm-up done", requests=count + WARMUP_BURST, seconds=round(time.perf_counter() - started, 2))
    return count + WARMUP_BURST


@dataclass(frozen=True)
class RunResult:
    """One workload on one engine, prefix caching on or off."""

    workload: str
    prefix_caching: bool
    num_requests: int  # sent
    completed: int  # ended with finish reason "length" or "stop"
    prompt_tokens: int
    output_tokens: int
    seconds: float  # wall time from the first submission to the last request's end
    ttft: LatencyStats  # client side: submit to first token
    e2e: LatencyStats  # client side: submit to end
    prefix_cache_queries: int | None  # tokens looked up in the cache during the run (metrics store)
    prefix_cache_hits: int | None  # of which found
    prefill_tokens_computed: int  # prompt tokens the engine computed during the run (metrics store)
    preemptions: int
    steps: int = 0  # engine steps during the run
    ttft_samples: tuple[float, ...] = ()  # sorted, seconds: for the CDF

    @classmethod
    def of(cls, workload: str, prefix_caching: bool, timings: Sequence[RequestTiming], seconds: float,
           store: StoreCounters) -> RunResult:
        ttfts = sorted(timing.ttft_s for timing in timings if timing.ttft_s is not None)
        return cls(
            workload=workload, prefix_caching=prefix_caching, num_requests=len(timings),
            completed=sum(timing.completed for timing in timings),
            prompt_tokens=sum(timing.prompt_tokens for timing in timings),
            output_tokens=sum(timing.output_tokens for timing in timings), seconds=seconds,
            ttft=LatencyStats.of(ttfts), e2e=LatencyStats.of([timing.e2e_s for timing in timings]),
            prefix_cache_queries=store.prefix_cache_queries, prefix_cache_hits=store.prefix_cache_hits,
            prefill_tokens_computed=store.prefill_tokens, preemptions=store.preemptions, steps=store.steps,
            ttft_samples=tuple(ttfts),
        )

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float | None:
        if self.prefix_cache_queries is None or self.prefix_cache_hits is None or self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s, "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class EngineOptions:
    model: str
    engine_args: dict[str, Any]
    check_invariants: bool = False


async def start_engine(options: EngineOptions, prefix_caching: bool) -> AsyncEngineClient:
    from vllm_actors.clients.async_client import AsyncEngineClient

    log.info("starting the engine", model=options.model, enable_prefix_caching=prefix_caching)
    started = time.perf_counter()
    client = await AsyncEngineClient.start(options.model, check_invariants=options.check_invariants,
                                           enable_prefix_caching=prefix_caching, **options.engine_args)
    log.info("engine ready", seconds=round(time.perf_counter() - started, 1))
    return client


def check_fits(workload: Workload, max_model_len: int) -> None:
    if workload.longest_sequence > max_model_len:
        raise ValueError(f"the {workload.name} workload needs {workload.longest_sequence} tokens of context "
                         f"(prompt + output) but max_model_len is {max_model_len}: raise --max-model-len or "
                         "shrink the workload")


async def measure_run(
    options: EngineOptions, workload: Workload, prefix_caching: bool, warmup_requests: int, seed: int
) -> RunResult:
    """A fresh engine: the warm-up, then the workload, timed; the engine is stopped on the way out."""
    client = await start_engine(options, prefix_caching)
    async with client:
        check_fits(workload, client.max_model_len)
        sent = await warm_up(client, workload.warmup_prompt_tokens, warmup_requests, client.vocab_size, seed)
        before = await settled_counters(client, sent)
        log.info("timed run", workload=workload.name, enable_prefix_caching=prefix_caching,
                 requests=workload.num_requests)
        started = time.perf_counter()
        timings = await workload.run(client)
        seconds = time.perf_counter() - started
        after = await settled_counters(client, sent + len(timings))
    result = RunResult.of(workload.name, prefix_caching, timings, seconds, after.since(before))
    log.info("timed run done", workload=workload.name, enable_prefix_caching=prefix_caching,
             seconds=round(seconds, 3), output_tok_s=round(result.output_tokens_per_s, 1),
             ttft_p50_ms=round(result.ttft.p50 * 1e3, 1), hit_rate=result.hit_rate)
    return result


# --------------------------------------------------------------------------- the report
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


# --------------------------------------------------------------------------- arguments
def parse_workloads(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"workloads are a comma-separated subset of {','.join(WORKLOAD_NAMES)}, "
                                         f"got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-actors bench prefix",
        description="Prefix caching on vs off: a shared system prompt and multi-turn chat.",
    )
    model = add_model_arguments(parser)
    model.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    model.add_argument("--max-model-len", type=int, default=4096, help="capped at the model's own maximum")
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--max-num-batched-tokens", type=int, default=None)
    model.add_argument("--num-gpu-blocks-override", type=int, default=None)
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument("--block-size", type=int, default=None)
    model.add_argument("--cpu-kv-cache-gib", type=float, default=None)
    model.add_argument("--scheduling-policy", default=None, help="passed to the engine when given (fcfs, lpm)")
    model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    model.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload and engine seed")

    workload = parser.add_argument_group("workloads")
    workload.add_argument("--workloads", type=parse_workloads, default=WORKLOAD_NAMES,
                          help="comma-separated, run in this order (default: shared,chat)")
    workload.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="output tokens per request")
    workload.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, help="shared: requests")
    workload.add_argument("--system-tokens", type=int, default=DEFAULT_SYSTEM_TOKENS,
                          help="shared: tokens of the common system prompt")
    workload.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS, help="chat: conversations")
    workload.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                          help="chat: conversations active at a time")
    workload.add_argument("--turns", type=int, default=DEFAULT_TURNS, help="chat: turns per conversation")
    workload.add_argument("--off-first", action="store_true",
                          help="run caching off before caching on (to see whether the order matters)")
    workload.add_argument("--warmup-requests", type=int, default=DEFAULT_WARMUP_REQUESTS,
                          help="unrelated requests before each timed run, each extending the previous "
                               "prompt (from 2 on, the path reusing cached blocks is warm too)")

    output = parser.add_argument_group("output")
    output.add_argument("--out", default="results/prefix", help="directory for results.json and prefix.png")
    output.add_argument("--log-level", default=os.environ.get("VLLM_ACTORS_LOG_LEVEL", "INFO"))
    return parser


PASS_THROUGH = ("max_num_batched_tokens", "num_gpu_blocks_override", "block_size", "cpu_kv_cache_gib",
                "scheduling_policy")  # given to the engine only when set


def engine_options(args: argparse.Namespace, model_path: str, load_format: str, max_model_len: int) -> EngineOptions:
    engine_args: dict[str, Any] = {
        "skip_tokenizer_init": True, "dtype": args.dtype, "device": args.device, "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization,
        "seed": args.seed, "enforce_eager": args.enforce_eager,
    }
    engine_args.update({name: getattr(args, name) for name in PASS_THROUGH if getattr(args, name) is not None})
    if load_format != "auto":
        engine_args["load_format"] = load_format
    check = os.environ.get("VLLM_ACTORS_CHECK_INVARIANTS", "") not in ("", "0")
    return EngineOptions(model=model_path, engine_args=engine_args, check_invariants=check)


def make_workloads(args: argparse.Namespace, vocab_size: int) -> list[Workload]:
    workloads: list[Workload] = []
    for name in args.workloads:
        if name == "shared":
            workloads.append(make_shared_workload(args.num_requests, args.system_tokens, args.max_tokens,
                                                  vocab_size, args.seed))
        else:
            workloads.append(make_chat_workload(args.conversations, args.turns, args.concurrency, args.max_tokens,
                                                vocab_size, args.seed))
    return workloads


def _config_record(args: argparse.Namespace, load_format: str, max_model_len: int,
                   workloads: Sequence[Workload]) -> dict[str, Any]:
    record: dict[str, Any] = {key: value for key, value in vars(args).items() if key != "workloads"}
    record["workloads"] = {workload.name: workload.describe() for workload in workloads}
    record["load_format"] = load_format
    record["resolved_max_model_len"] = max_model_len
    record["sampling"] = {"temperature": 0.0, "ignore_eos": True}
    record["model_description"] = (
        "Qwen3-0.6B shape, random weights (load_format=dummy)" if args.model is None
        else f"{args.model} (load_format={load_format})"
    )
    record["python"] = sys.version.split()[0]
    try:
        import torch

        record["torch"] = torch.__version__
        record["cuda_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return record


# --------------------------------------------------------------------------- main
async def run_all(args: argparse.Namespace, options: EngineOptions, workloads: Sequence[Workload],
                  report: PrefixReport, out_json: Path) -> bool:
    """Every workload with caching on and off (``--off-first``: off, then on); a failed run is
    recorded and the others go on. False when any run failed."""
    ok = True
    order = (False, True) if args.off_first else (True, False)
    for workload in workloads:
        for prefix_caching in order:
            try:
                report.add(await measure_run(options, workload, prefix_caching, args.warmup_requests, args.seed))
            except Exception as exc:
                log.exception("benchmark run failed", workload=workload.name, enable_prefix_caching=prefix_caching)
                report.errors[f"{workload.name}/{caching_key(prefix_caching)}"] = f"{type(exc).__name__}: {exc}"
                ok = False
            write_json(report, out_json)
    return ok


def run(args: argparse.Namespace) -> tuple[PrefixReport, int]:
    """Every run, then the JSON and the plot; returns the report and the exit status (1: a run failed)."""
    from vllm_actors.models.config import ModelConfig

    started = time.perf_counter()
    out_dir = Path(args.out)
    out_json = out_dir / "results.json"
    load_format = args.load_format or ("dummy" if args.model is None else "auto")
    with tempfile.TemporaryDirectory(prefix="vllm-actors-bench-prefix-") as scratch:
        model_path = args.model or str(write_model_dir(Path(scratch) / "qwen3-0.6b-shape"))
        model_config = ModelConfig.from_path(model_path)
        max_model_len = min(args.max_model_len, model_config.max_position_embeddings)
        workloads = make_workloads(args, model_config.vocab_size)
        for workload in workloads:
            check_fits(workload, max_model_len)
        out_dir.mkdir(parents=True, exist_ok=True)
        report = PrefixReport(config=_config_record(args, load_format, max_model_len, workloads))
        options = engine_options(args, model_path, load_format, max_model_len)
        ok = asyncio.run(run_all(args, options, workloads, report, out_json))
    report.total_seconds = time.perf_counter() - started
    write_json(report, out_json)
    if write_png(report, out_dir / "prefix.png"):
        log.info("plot written", path=str(out_dir / "prefix.png"))
    return report, 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging(args.log_level)
    try:
        report, status = run(args)
    except ValueError as exc:  # a workload that cannot run with these arguments
        parser.error(str(exc))
    print(format_report(report))
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return status
