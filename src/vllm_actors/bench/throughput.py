"""``vllm-actors bench throughput``: nano-vllm's throughput benchmark, with its floor, a peer, and
where the time goes.

The workload (nano-vllm's bench): 256 requests drawn after ``random.seed(0)`` - first every
prompt, ``randint(100, 1024)`` tokens of ``randint(0, 10000)``, then every ``max_tokens``,
``randint(100, 1024)`` - sampled at temperature 0.6 with EOS ignored: 133,966 output tokens. The
model has Qwen3-0.6B's shape with random weights (``load_format="dummy"``) unless ``--model``
names a checkpoint. Throughput = output tokens / wall time of ``llm.generate`` through the
process group, after a warm-up.

In the same run, in this order (the GPU is left to each part alone):

1. ours: the timed run, then the metrics store's event log (GPU idle share between decode steps,
   step times, TTFT / ITL) and batch-1 decode on the same engine;
2. batch-1 decode on a second engine with CUDA graphs the other way (``enforce_eager`` flipped);
3. the GPU's copy bandwidth and bf16 matmul rate, and the workload's floor from them (floor.py);
4. the transformers peer on the same requests (peer_transformers.py);
5. the table on stdout, ``results.json`` and ``throughput.png`` under ``--out``.

``results.json`` is rewritten after every part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from vllm_actors.bench.floor import Floor, GpuCeilings, ModelShape, measure_ceilings, workload_floor
from vllm_actors.bench.report import (
    Batch1Result,
    BenchReport,
    EngineMetrics,
    IdleShare,
    LatencyStats,
    OursResult,
    format_table,
    write_json,
    write_png,
)

log = structlog.get_logger(__name__)

# --------------------------------------------------------------------------- the workload
TEMPERATURE = 0.6
DEFAULT_NUM_REQUESTS = 256
PROMPT_LEN_RANGE = (100, 1024)
OUTPUT_LEN_RANGE = (100, 1024)
TOKEN_ID_RANGE = (0, 10000)
DEFAULT_SEED = 0
EXPECTED_OUTPUT_TOKENS = 133_966  # of the default workload (256 requests, seed 0)

# Qwen3-0.6B's config.json (the shape; the weights are random).
QWEN3_0_6B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.max_tokens[:count])

    def fit_vocab(self, vocab_size: int) -> Workload:
        """Token ids folded into ``[0, vocab_size)`` (only tiny test models have fewer than 10,001)."""
        if vocab_size > TOKEN_ID_RANGE[1]:
            return self
        return Workload([[token % vocab_size for token in prompt] for prompt in self.prompts], self.max_tokens)


def make_workload(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = DEFAULT_SEED,
) -> Workload:
    """nano-vllm's requests: at least the standard 256 are drawn (so a subset is the head of the
    standard workload), then the first ``num_requests`` are kept; prompts are cut to
    ``max_input_len`` and ``max_tokens`` capped at ``max_output_len`` (for scaled-down runs)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    rng = random.Random(seed)  # the same stream as random.seed(seed) and the module's functions
    drawn = max(num_requests, DEFAULT_NUM_REQUESTS)
    prompts = [
        [rng.randint(*TOKEN_ID_RANGE) for _ in range(rng.randint(*PROMPT_LEN_RANGE))] for _ in range(drawn)
    ]
    max_tokens = [rng.randint(*OUTPUT_LEN_RANGE) for _ in range(drawn)]
    prompts, max_tokens = prompts[:num_requests], max_tokens[:num_requests]
    if max_input_len is not None:
        prompts = [prompt[:max_input_len] for prompt in prompts]
    if max_output_len is not None:
        max_tokens = [min(limit, max_output_len) for limit in max_tokens]
    return Workload(prompts, max_tokens)


def write_model_dir(path: Path, config: dict[str, Any] | None = None) -> Path:
    """A Hugging Face directory with only ``config.json`` (for ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or QWEN3_0_6B_CONFIG, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- arguments
def add_model_arguments(parser: argparse.ArgumentParser) -> Any:
    """The benchmarks' "model and engine" group with its first options (--model, --load-format,
    --dtype); returns the group for the benchmark's own."""
    model = parser.add_argument_group("model and engine")
    model.add_argument("--model", default=None,
                       help="a checkpoint (HF directory or .gguf); default: Qwen3-0.6B's shape, random weights")
    model.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                       help="default: dummy without --model, auto with it")
    model.add_argument("--dtype", default="bfloat16")
    return model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-actors bench throughput",
        description="Offline throughput on nano-vllm's workload, against the GPU's floor and transformers.",
    )
    model = add_model_arguments(parser)
    model.add_argument("--max-model-len", type=int, default=4096)
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in the timed run")
    model.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn prefix caching off (the workload's random prompts share nothing)")
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload and engine seed")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                          help="the first N requests of the workload")
    workload.add_argument("--max-input-len", type=int, default=PROMPT_LEN_RANGE[1], help="cut prompts to this")
    workload.add_argument("--max-output-len", type=int, default=OUTPUT_LEN_RANGE[1], help="cap max_tokens")
    workload.add_argument("--warmup-requests", type=int, default=4,
                          help="short requests (64-token prompts, 16 tokens) before the timed run")

    floor = parser.add_argument_group("floor")
    floor.add_argument("--no-floor", action="store_true", help="do not measure the GPU's ceilings")
    floor.add_argument("--bandwidth", type=float, default=None,
                       help="bytes/s to compute the floor with instead of the measured copy bandwidth")
    floor.add_argument("--matmul-rate", type=float, default=None,
                       help="FLOP/s to compute the floor with instead of the measured bf16 matmul rate")

    peer = parser.add_argument_group("peer")
    peer.add_argument("--peer", choices=("transformers", "none"), default="transformers")
    peer.add_argument("--no-peer", dest="peer", action="store_const", const="none", help="same as --peer none")
    peer.add_argument("--peer-num-requests", type=int, default=None,
                      help="run the peer on the first N requests only (default: --num-requests)")
    peer.add_argument("--peer-attn", default=None,
                      help="transformers attn_implementation (default: its paged sdpa)")
    peer.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds")

    batch1 = parser.add_argument_group("batch-1 decode")
    batch1.add_argument("--no-batch1", action="store_true")
    batch1.add_argument("--batch1-input-len", type=int, default=1024)
    batch1.add_argument("--batch1-output-len", type=int, default=256)
    batch1.add_argument("--batch1-same-engine-only", action="store_true",
                        help="skip the second engine (CUDA graphs the other way)")

    output = parser.add_argument_group("output")
    output.add_argument("--out", default="results/throughput", help="directory for results.json, throughput.png")
    output.add_argument("--keep-events", action="store_true", help="also keep the event log as events.jsonl.gz")
    output.add_argument("--log-level", default=os.environ.get("VLLM_ACTORS_LOG_LEVEL", "INFO"))
    return parser


def is_default_workload(args: argparse.Namespace) -> bool:
    return (args.num_requests == DEFAULT_NUM_REQUESTS and args.seed == DEFAULT_SEED
            and args.max_input_len >= PROMPT_LEN_RANGE[1] and args.max_output_len >= OUTPUT_LEN_RANGE[1])


# --------------------------------------------------------------------------- the event log
def read_event_log(path: Path) -> list[dict[str, Any]]:
    """The metrics store's dump: one flat dict per event (actor, seq, mono, wall, type, fields)."""
    decoder = msgspec.json.Decoder()
    with path.open("rb") as handle:
        return [decoder.decode(line) for line in handle if line.strip()]


def worker_steps(records: Iterable[dict[str, Any]], since_wall: float | None = None) -> list[dict[str, Any]]:
    """STEP_FINISHED events of the workers (from ``since_wall`` on), by actor then step id."""
    steps = [
        record for record in records
        if record.get("type") == "STEP_FINISHED" and str(record.get("actor", "")).startswith("worker")
        and (since_wall is None or record["wall"] >= since_wall)
    ]
    return sorted(steps, key=lambda record: (record["actor"], record["step_id"]))


def is_decode_only(step: dict[str, Any]) -> bool:
    return step["num_seqs"] > 0 and step["num_tokens"] == step["num_seqs"]


def _consecutive(steps: Sequence[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], dict[str, Any]]]:
    for previous, current in itertools.pairwise(steps):
        if previous["actor"] == current["actor"] and current["step_id"] == previous["step_id"] + 1:
            yield previous, current


def decode_idle_share(steps: Sequence[dict[str, Any]]) -> IdleShare | None:
    """GPU idle share between consecutive decode-only steps: Σ max(0, Δmono of their STEP_FINISHED
    - execute_ms of the later step) / Σ Δmono. ``steps`` as ``worker_steps`` returns them."""
    idle = interval = 0.0
    pairs = 0
    for previous, current in _consecutive(steps):
        if not (is_decode_only(previous) and is_decode_only(current)):
            continue
        elapsed = current["mono"] - previous["mono"]
        if elapsed < 0:
            continue
        idle += max(0.0, elapsed - current["execute_ms"] / 1e3)
        interval += elapsed
        pairs += 1
    if pairs == 0:
        return None
    return IdleShare(share=idle / interval if interval > 0 else 0.0, idle_s=idle, interval_s=interval, pairs=pairs)


def step_series(steps: Sequence[dict[str, Any]], start_wall: float) -> list[dict[str, float]]:
    """Per step, for the plot: seconds since ``start_wall``, execute and finish-to-finish ms, batch."""
    series: list[dict[str, float]] = []
    previous: dict[str, Any] | None = None
    for step in steps:
        consecutive = previous is not None and previous["actor"] == step["actor"] \
            and step["step_id"] == previous["step_id"] + 1
        interval_ms = (step["mono"] - previous["mono"]) * 1e3 if consecutive and previous else step["execute_ms"]
        series.append({"t": step["wall"] - start_wall, "execute_ms": step["execute_ms"], "interval_ms": interval_ms,
                       "num_seqs": step["num_seqs"], "num_tokens": step["num_tokens"]})
        previous = step
    return series


def request_latencies(
    records: Iterable[dict[str, Any]], request_ids: set[str]
) -> tuple[LatencyStats, LatencyStats, int]:
    """TTFT (ARRIVED -> FIRST_TOKEN, wall clocks: two actors) and ITL (consecutive TOKENS of a
    request, one actor's mono clock) of ``request_ids``; and how many of them had an ARRIVED."""
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    last_token: dict[str, tuple[str, float, float]] = {}
    gaps: list[float] = []
    for record in records:
        kind = record.get("type")
        if kind == "ARRIVED" and record["request_id"] in request_ids:
            arrived.setdefault(record["request_id"], record["wall"])
        elif kind == "FIRST_TOKEN" and record["request_id"] in request_ids:
            first_token.setdefault(record["request_id"], record["wall"])
        elif kind == "TOKENS":
            actor, mono, wall = record["actor"], record["mono"], record["wall"]
            for request_id in record["request_ids"]:
                if request_id not in request_ids:
                    continue
                last = last_token.get(request_id)
                if last is not None:
                    gaps.append(max(0.0, mono - last[1] if last[0] == actor else wall - last[2]))
                last_token[request_id] = (actor, mono, wall)
    ttfts = [max(0.0, first_token[rid] - arrived[rid]) for rid in request_ids if rid in arrived and rid in first_token]
    return LatencyStats.of(ttfts), LatencyStats.of(gaps), len(arrived)


def _percentiles_dict(value: Any) -> dict[str, Any]:
    return msgspec.to_builtins(value) if isinstance(value, msgspec.Struct) else dict(value)


# --------------------------------------------------------------------------- our engine
def _make_llm(args: argparse.Namespace, model_path: str, load_format: str, enforce_eager: bool) -> Any:
    from vllm_actors.llm import LLM

    engine_args: dict[str, Any] = {
        "skip_tokenizer_init": True, "dtype": args.dtype, "max_model_len": args.max_model_len, "seed": args.seed,
        "enforce_eager": enforce_eager, "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
    }
    if not args.enable_prefix_caching:
        engine_args["enable_prefix_caching"] = False
    if load_format != "auto":
        engine_args["load_format"] = load_format  # only passed when needed: older engines lack the argument
    log.info("starting the engine", model=model_path, enforce_eager=enforce_eager, load_format=load_format)
    start = time.perf_counter()
    llm = LLM(model=model_path, **engine_args)
    log.info("engine ready", seconds=round(time.perf_counter() - start, 1))
    return llm


def _sampling(max_tokens: int) -> Any:
    from vllm_actors.protocol.sampling import SamplingParams

    return SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=max_tokens)


class EngineSession:
    """One LLM and the number of requests given to it (to know when the metrics store caught up)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.submitted = 0

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> tuple[list[Any], float]:
        inputs = [{"prompt_token_ids": list(prompt)} for prompt in prompts]
        params = [_sampling(limit) for limit in max_tokens]
        self.submitted += len(inputs)
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return outputs, time.perf_counter() - start

    def warm_up(self, workload: Workload, count: int) -> None:
        if count <= 0:
            return
        prompts = [workload.prompts[i % len(workload)][:64] for i in range(count)]
        _, seconds = self.generate(prompts, [16] * count)
        log.info("warm-up done", requests=count, seconds=round(seconds, 2))

    def wait_for_store(self, timeout_s: float = 30.0) -> Any:
        """The store's summary once it has seen every request end (events travel on their own bus)."""
        deadline = time.monotonic() + timeout_s
        while True:
            summary = self.llm.get_metrics()
            if summary.requests_finished + summary.requests_aborted >= self.submitted:
                return summary
            if time.monotonic() > deadline:
                log.warning("the metrics store has not seen every request end", seen=summary.requests_finished,
                            submitted=self.submitted)
                return summary
            time.sleep(0.05)

    def dump_events(self, path: Path) -> Path:
        from vllm_actors.protocol.metrics import DumpQuery, DumpReply

        query = self.llm.engine.query_metrics
        kwargs = {"timeout_ms": 120_000} if "timeout_ms" in inspect.signature(query).parameters else {}
        reply = query(DumpQuery(path=str(path.resolve())), **kwargs)
        if not isinstance(reply, DumpReply):
            raise RuntimeError(f"the metrics store could not dump its event log: {reply!r}")
        log.info("event log dumped", path=reply.path, events=reply.num_events)
        return Path(reply.path)

    def batch1(self, args: argparse.Namespace, enforce_eager: bool, vocab_size: int) -> Batch1Result:
        """One request alone: a ``--batch1-input-len`` prompt, ``--batch1-output-len`` tokens."""
        rng = random.Random(args.seed + 1)
        prompt = [rng.randint(*TOKEN_ID_RANGE) % vocab_size for _ in range(args.batch1_input_len)]
        outputs, seconds = self.generate([prompt], [args.batch1_output_len])
        request_id = outputs[0].request_id
        timeline = self._finished_timeline(request_id)
        entries = {entry.type: entry for entry in reversed(timeline.events)}  # the first of each type
        start = entries.get("ARRIVED") or entries.get("QUEUED")
        first, finished = entries.get("FIRST_TOKEN"), entries.get("FINISHED")
        if start is None or first is None or finished is None:
            raise RuntimeError(f"batch-1 request {request_id}: incomplete timeline "
                               f"({sorted(entries)}, {timeline.dropped} dropped)")
        produced = int(finished.event.num_output_tokens)
        ttft, e2e = _elapsed(start, first), _elapsed(start, finished)
        decode = _elapsed(first, finished)  # = e2e - ttft, on one clock where one actor stamped both
        result = Batch1Result(
            enforce_eager=enforce_eager, prompt_tokens=len(prompt), output_tokens=produced, ttft_s=ttft, e2e_s=e2e,
            ms_per_token=decode / (produced - 1) * 1e3 if produced > 1 else 0.0, client_seconds=seconds,
        )
        log.info("batch-1 decode", enforce_eager=enforce_eager, ms_per_token=round(result.ms_per_token, 3),
                 ttft_ms=round(ttft * 1e3, 1), tokens=produced)
        return result

    def _finished_timeline(self, request_id: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            timeline = self.llm.get_timeline(request_id)
            if timeline.found and any(entry.type == "FINISHED" for entry in timeline.events):
                return timeline
            if time.monotonic() > deadline:
                return timeline
            time.sleep(0.05)


def _elapsed(start: Any, end: Any) -> float:
    """Seconds between two timeline entries: mono within one actor, wall across actors."""
    seconds = end.mono - start.mono if start.actor == end.actor else end.wall - start.wall
    return max(seconds, 0.0)


def measure_ours(
    args: argparse.Namespace, session: EngineSession, workload: Workload, report: BenchReport, events_dir: Path
) -> tuple[list[dict[str, Any]], float]:
    """The timed run and its metrics into ``report``; returns the run's worker steps and the wall
    clock when it started."""
    session.warm_up(workload, args.warmup_requests)
    log.info("timed run", requests=len(workload), prompt_tokens=workload.prompt_tokens,
             output_tokens=workload.output_tokens)
    start_wall = time.time()
    outputs, seconds = session.generate(workload.prompts, workload.max_tokens)
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    report.ours = OursResult(
        num_requests=len(workload), prompt_tokens=workload.prompt_tokens, output_tokens=produced,
        expected_output_tokens=workload.output_tokens, seconds=seconds, enforce_eager=args.enforce_eager,
    )
    log.info("timed run done", seconds=round(seconds, 3), tok_s=round(report.ours.tokens_per_s, 1))
    if produced != workload.output_tokens:
        log.warning("output tokens differ from the workload's", produced=produced, expected=workload.output_tokens)

    summary = session.wait_for_store()
    records = read_event_log(session.dump_events(events_dir / "events.jsonl"))
    steps = worker_steps(records, since_wall=start_wall)
    request_ids = {output.request_id for output in outputs}
    ttft, itl, seen = request_latencies(records, request_ids)
    decode_ms = [step["execute_ms"] for step in steps if is_decode_only(step)]
    report.metrics = EngineMetrics(
        idle=decode_idle_share(steps),
        ttft=ttft,
        itl=itl,
        decode_step_ms=LatencyStats.of(decode_ms),
        num_steps=len(steps),
        num_decode_steps=len(decode_ms),
        events_in_log=len(records),
        log_complete=seen == len(request_ids),
        store_summary={
            "ttft": _percentiles_dict(summary.ttft), "itl": _percentiles_dict(summary.itl),
            "step_ms": _percentiles_dict(summary.step_ms), "steps": summary.steps,
            "generation_tokens": summary.generation_tokens, "preemptions": summary.preemptions,
            "requests_finished": summary.requests_finished,
        },
    )
    if report.metrics.idle is not None:
        log.info("gpu idle between decode steps", share=round(report.metrics.idle.share, 4))
    return steps, start_wall


# --------------------------------------------------------------------------- the other parts
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def model_shape(model_path: str, dtype: str) -> ModelShape:
    from vllm_actors.models.config import ModelConfig

    config = ModelConfig.from_path(model_path)
    dtype_bytes = 4 if dtype in ("float32", "float") else 2
    return ModelShape(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings, qk_norm=config.qk_norm, dtype_bytes=dtype_bytes,
    )


def compute_floor(
    args: argparse.Namespace, shape: ModelShape, workload: Workload
) -> tuple[GpuCeilings | None, Floor | None]:
    ceilings: GpuCeilings | None = None
    bandwidth, rate = args.bandwidth, args.matmul_rate
    if (bandwidth is None or rate is None) and not args.no_floor:
        if _cuda_available():
            ceilings = measure_ceilings()
            bandwidth = bandwidth if bandwidth is not None else ceilings.bandwidth
            rate = rate if rate is not None else ceilings.matmul_rate
        else:
            log.warning("no CUDA device: the GPU's ceilings are not measured (give --bandwidth and --matmul-rate "
                        "to compute the floor anyway)")
    if bandwidth is None or rate is None:
        return ceilings, None
    floor = workload_floor(
        [len(prompt) for prompt in workload.prompts], workload.max_tokens, shape,
        bandwidth=bandwidth, matmul_rate=rate, max_num_seqs=args.max_num_seqs,
    )
    log.info("floor", seconds=round(floor.seconds, 3), tok_s=round(floor.tokens_per_s, 1))
    return ceilings, floor


def run_peer(args: argparse.Namespace, model_path: str, workload: Workload, random_weights: bool) -> Any:
    if not _cuda_available():
        log.warning("no CUDA device: the transformers peer is skipped")
        return None
    from vllm_actors.bench.peer_transformers import run_transformers_peer

    subset = workload.head(args.peer_num_requests or len(workload))
    return run_transformers_peer(
        model_path, subset.prompts, subset.max_tokens, random_weights=random_weights, temperature=TEMPERATURE,
        seed=args.seed, attn_implementation=args.peer_attn, timeout_s=args.peer_timeout,
    )


def _config_record(args: argparse.Namespace, load_format: str, workload: Workload) -> dict[str, Any]:
    record: dict[str, Any] = dict(vars(args))
    record["load_format"] = load_format
    record["model_description"] = (
        "Qwen3-0.6B shape, random weights (load_format=dummy)" if args.model is None
        else f"{args.model} (load_format={load_format})"
    )
    record["workload"] = {"num_requests": len(workload), "prompt_tokens": workload.prompt_tokens,
                          "output_tokens": workload.output_tokens, "temperature": TEMPERATURE, "ignore_eos": True}
    record["python"] = sys.version.split()[0]
    try:
        import torch

        record["torch"] = torch.__version__
    except ImportError:
        pass
    return record


def _batch1_key(enforce_eager: bool) -> str:
    return "graphs_off" if enforce_eager else "graphs_on"


@contextmanager
def _part(report: BenchReport, name: str, out_json: Path) -> Iterator[None]:
    """Runs one optional part: its failure is recorded in the report instead of ending the run;
    the results so far are written either way."""
    try:
        yield
    except Exception as exc:
        log.exception("benchmark part failed", part=name)
        report.errors[name] = f"{type(exc).__name__}: {exc}"
    finally:
        write_json(report, out_json)


# --------------------------------------------------------------------------- main
def _run_ours(
    args: argparse.Namespace, model_path: str, load_format: str, shape: ModelShape, workload: Workload,
    report: BenchReport, scratch_dir: Path, out_json: Path,
) -> bool:
    """Part 1: the timed run, its metrics and batch-1 on the same engine. False if the run failed."""
    try:
        with _make_llm(args, model_path, load_format, args.enforce_eager) as llm:
            session = EngineSession(llm)
            steps, start_wall = measure_ours(args, session, workload, report, scratch_dir)
            report.steps = step_series(steps, start_wall)
            write_json(report, out_json)
            if not args.no_batch1:
                key = _batch1_key(args.enforce_eager)
                with _part(report, f"batch1_{key}", out_json):
                    report.batch1[key] = session.batch1(args, args.enforce_eager, shape.vocab_size)
    except Exception as exc:
        log.exception("the timed run failed")
        report.errors["ours"] = f"{type(exc).__name__}: {exc}"
        write_json(report, out_json)
        return False
    finally:
        events = scratch_dir / "events.jsonl"
        if args.keep_events and events.is_file():
            with events.open("rb") as source, gzip.open(Path(args.out) / "events.jsonl.gz", "wb") as target:
                shutil.copyfileobj(source, target)
    return True


def _run_other_batch1(
    args: argparse.Namespace, model_path: str, load_format: str, shape: ModelShape, workload: Workload,
    report: BenchReport, out_json: Path,
) -> None:
    """Part 2: batch-1 on a second engine with CUDA graphs the other way (the first is shut down)."""
    other = not args.enforce_eager
    key = _batch1_key(other)
    with _part(report, f"batch1_{key}", out_json), _make_llm(args, model_path, load_format, other) as llm:
        session = EngineSession(llm)
        session.warm_up(workload, max(1, args.warmup_requests))
        report.batch1[key] = session.batch1(args, other, shape.vocab_size)


def run(args: argparse.Namespace) -> tuple[BenchReport, int]:
    """Every part in order; returns the report and the exit status (1 if our timed run failed)."""
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_json = out_dir / "results.json"

    workload = make_workload(args.num_requests, args.max_input_len, args.max_output_len, args.seed)
    if is_default_workload(args) and workload.output_tokens != EXPECTED_OUTPUT_TOKENS:
        raise AssertionError(f"the default workload has {workload.output_tokens} output tokens, "
                             f"expected {EXPECTED_OUTPUT_TOKENS}")
    load_format = args.load_format or ("dummy" if args.model is None else "auto")

    with tempfile.TemporaryDirectory(prefix="vllm-actors-bench-") as scratch:
        scratch_dir = Path(scratch)
        model_path = args.model or str(write_model_dir(scratch_dir / "qwen3-0.6b-shape"))
        shape = model_shape(model_path, args.dtype)
        if shape.vocab_size <= TOKEN_ID_RANGE[1]:
            log.warning("the model's vocabulary is smaller than the workload's token ids: folding them",
                        vocab_size=shape.vocab_size)
            workload = workload.fit_vocab(shape.vocab_size)
        report = BenchReport(config=_config_record(args, load_format, workload))

        ok = _run_ours(args, model_path, load_format, shape, workload, report, scratch_dir, out_json)
        if ok and not args.no_batch1 and not args.batch1_same_engine_only:
            _run_other_batch1(args, model_path, load_format, shape, workload, report, out_json)
        with _part(report, "floor", out_json):
            report.ceilings, report.floor = compute_floor(args, shape, workload)
        if ok and args.peer == "transformers":
            with _part(report, "peer", out_json):
                report.peer = run_peer(args, model_path, workload, random_weights=load_format == "dummy")

    report.total_seconds = time.perf_counter() - started
    with _part(report, "plot", out_json):
        if write_png(report, out_dir / "throughput.png"):
            log.info("plot written", path=str(out_dir / "throughput.png"))
    return report, 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging(args.log_level)
    report, status = run(args)
    print(format_table(report))
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return status
