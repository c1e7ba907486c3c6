"""``vllm-actors bench simulate``: the scheduler on a virtual clock. The real ``Scheduler`` (the
same state machine the actor runs) admits, preempts and plans; each step takes the time a fixed
step cost model gives (``a + b * prefill tokens + c * decoding sequences``); the mixed workload of
``bench serve --workload mixed`` arrives on that clock; a token reaches its client ``transit``
seconds after its step. No processes, no model, no clock: the same figures on any machine.

What it answers: given a GPU's step costs (``--cost A B C``, or ``--fit-trace`` to fit them to a
real run's Chrome trace), which policy meets the deadlines at which rate, and whether a miss is
the scheduler's doing. The default costs are fitted to an H100 serving run of the Qwen3-0.6B shape
in bf16 (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_actors.actors.scheduler.cost_model import FixedCostModel
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.bench.serve_client import RequestResult
from vllm_actors.bench.serve_mixed import BATCH, INTERACTIVE, MixedRequest, MixedWorkload, attainment, mixed_requests
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

H100_QWEN3_06B = FixedCostModel(a=0.007, b=4e-6, c=2e-5)
TOKEN = 7  # every sampled token (ignore_eos: lengths are max_tokens)


@dataclass
class SimConfig:
    policy: str = "fcfs"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_blocks: int = 20_000  # of 16 tokens: 320k tokens, an H100's pool for this model
    transit: float = 0.001  # seconds from a step's end to its tokens at the client
    cost: FixedCostModel = field(default_factory=lambda: H100_QWEN3_06B)


@dataclass
class SimResult:
    policy: str
    attainment: dict[str, Any]  # bench serve's figures per class (serve_mixed.attainment)
    steps: int
    step_ms: dict[str, float]  # p50, p99, max
    max_running: int
    preemptions: int


def _add(request: MixedRequest) -> AddRequest:
    body = request.extra or {}
    ttft, e2e = body.get("ttft_target_ms"), body.get("e2e_target_ms")
    return AddRequest(request_id=str(request.index), prompt_token_ids=request.prompt,
                      params=SamplingParams(max_tokens=request.max_tokens, ignore_eos=True), eos_token_ids=[0],
                      priority=int(body.get("priority", 0)), arrival_time=request.offset,
                      ttft_deadline=None if ttft is None else request.offset + ttft / 1e3,
                      e2e_deadline=None if e2e is None else request.offset + e2e / 1e3)


def _plans(out: Outputs) -> list[StepPlan]:
    return [message for message in out.to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]


def simulate(workload: MixedWorkload, config: SimConfig) -> SimResult:
    """Run ``workload`` through a scheduler of ``config`` to the last request's end."""
    scheduler = Scheduler(SchedulerConfig(
        max_model_len=8192, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=True, block_size=16, num_blocks=config.num_blocks, max_steps_in_flight=1,
        enable_prefix_caching=False, scheduling_policy=config.policy), cost_model=config.cost)
    requests = mixed_requests(workload)
    results = {r.index: RequestResult(index=r.index, prompt_len=len(r.prompt), max_tokens=r.max_tokens,
                                      start=r.offset) for r in requests}
    last_token: dict[int, float] = {}
    steps: list[float] = []
    max_running = 0
    clock, arrived, plans = 0.0, 0, []
    while arrived < len(requests) or scheduler.requests:
        while arrived < len(requests) and requests[arrived].offset <= clock:
            plans += _plans(scheduler.handle(_add(requests[arrived])))
            arrived += 1
        if not plans:  # idle: on to the next arrival
            clock = requests[arrived].offset if arrived < len(requests) else clock
            continue
        plan = plans.pop()  # one step in flight: at most one plan is ever pending
        decodes = sum(1 for n in plan.num_tokens if n == 1)
        seconds = config.cost.step_seconds(sum(plan.num_tokens) - decodes, decodes)
        clock += seconds
        steps.append(seconds)
        max_running = max(max_running, len(scheduler.running))
        sampled = [rid for rid in plan.req_ids if rid in scheduler.requests and scheduler.requests[rid].num_pending]
        plans += _plans(scheduler.handle(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=sampled,
                                                    token_ids=[TOKEN] * len(sampled), execute_seconds=seconds)))
        for request_id in sampled:
            index = int(request_id)
            result, when = results[index], clock + config.transit
            if result.output_tokens == 0:
                result.ttft = when - result.start
            else:
                result.itl.append(when - last_token[index])
            last_token[index] = when
            result.output_tokens += 1
            if result.output_tokens >= result.max_tokens:
                result.ok, result.e2e, result.chunks = True, when - result.start, result.output_tokens
    quantiles = statistics.quantiles(steps, n=100) if len(steps) > 1 else [0.0] * 99
    return SimResult(policy=config.policy, attainment=attainment(list(results.values()), requests,
                                                                 workload.classes, 0.0),
                     steps=len(steps), step_ms={"p50": quantiles[49] * 1e3, "p99": quantiles[98] * 1e3,
                                                "max": max(steps, default=0.0) * 1e3},
                     max_running=max_running, preemptions=scheduler.stats.num_preemptions)


def fit_costs(trace_path: Path) -> tuple[FixedCostModel, int]:
    """The step cost model that fits a Chrome trace's worker steps (``stats --trace``, ``bench serve
    --trace``) by least squares: each ``step N`` slice's ``execute_ms`` against its prefill tokens
    (its tokens less its decodes) and decodes (its sequences less its prefill sequences).
    Returns the model and the number of steps it was fitted on."""
    raw = trace_path.read_bytes()
    document = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    events = document["traceEvents"] if isinstance(document, dict) else document
    rows, seconds = [], []
    for event in events:
        args = event.get("args") or {}
        if event.get("ph") != "X" or not str(event.get("name", "")).startswith("step ") or "execute_ms" not in args:
            continue
        decodes = max(int(args["num_seqs"]) - int(args.get("num_prefill_seqs", 0)), 0)
        rows.append([1.0, max(int(args["num_tokens"]) - decodes, 0), decodes])
        seconds.append(float(args["execute_ms"]) / 1e3)
    if len(rows) < 3:
        raise ValueError(f"{trace_path}: {len(rows)} worker steps with execute_ms, at least 3 needed to fit")
    (a, b, c), *_ = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)
    return FixedCostModel(a=max(float(a), 0.0), b=max(float(b), 0.0), c=max(float(c), 0.0)), len(rows)


def format_table(rate: float, results: list[SimResult]) -> str:
    rows = ["| policy | interactive met (in bursts) | batch met | interactive TTFT p99 (ms) | "
            "batch tok/s | steps p50 / p99 (ms) | max running | preemptions |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        classes, bursts = result.attainment["classes"], result.attainment["in_bursts"]
        interactive, batch = classes[INTERACTIVE.name], classes[BATCH.name]
        rows.append(
            f"| {result.policy} | {interactive['attainment']:.1%} ({bursts[INTERACTIVE.name]['attainment']:.1%}) | "
            f"{batch['attainment']:.1%} | {interactive['ttft'].get('p99', 0.0) * 1e3:,.1f} | "
            f"{batch['output_tok_s']:,.0f} | {result.step_ms['p50']:.1f} / {result.step_ms['p99']:.1f} | "
            f"{result.max_running} | {result.preemptions} |")
    return f"Simulated mixed workload at {rate:g}/s\n\n" + "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-actors bench simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[80.0])
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=["fcfs", "priority", "edf", "lrs"])
    parser.add_argument("--cost", type=float, nargs=3, metavar=("A", "B", "C"),
                        default=[H100_QWEN3_06B.a, H100_QWEN3_06B.b, H100_QWEN3_06B.c],
                        help="step seconds = A + B x prefill tokens + C x decoding sequences")
    parser.add_argument("--fit-trace", type=Path, default=None, metavar="TRACE",
                        help="fit the cost model to this Chrome trace's worker steps instead (.json or .json.gz)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--transit-ms", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=None, help="write simulate.json and simulate.md here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cost = FixedCostModel(*args.cost)
    if args.fit_trace is not None:
        cost, num_steps = fit_costs(args.fit_trace)
        print(f"cost model fitted to {num_steps} steps of {args.fit_trace}: a = {cost.a * 1e3:.3f} ms, "
              f"b = {cost.b * 1e6:.3f} us per prefill token, c = {cost.c * 1e6:.3f} us per decode", flush=True)
    record: dict[str, Any] = {"cost": [cost.a, cost.b, cost.c], "duration": args.duration, "seed": args.seed,
                              "rates": {}}
    tables = []
    for rate in args.rates:
        workload = MixedWorkload(rate=rate, duration=args.duration, seed=args.seed)
        results = [simulate(workload, SimConfig(policy=policy, max_num_seqs=args.max_num_seqs,
                                                max_num_batched_tokens=args.max_num_batched_tokens,
                                                transit=args.transit_ms / 1e3, cost=cost))
                   for policy in args.policies]
        tables.append(format_table(rate, results))
        print(tables[-1], flush=True)
        record["rates"][str(rate)] = [result.__dict__ for result in results]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "simulate.json").write_text(json.dumps(record, indent=1, default=str))
        (args.out / "simulate.md").write_text("\n\n".join(tables) + "\n")
    return 0
