"""``vllm-actors bench throughput``: our engine - the warm-up, the timed run, its metrics from the
event log, and batch-1 decode."""

from __future__ import annotations

import argparse
import inspect
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.bench.event_log import (
    decode_idle_share,
    gpu_busy_shares,
    is_decode_only,
    percentiles_dict,
    read_event_log,
    request_latencies,
    worker_steps,
)
from vllm_actors.bench.report import Batch1Result, BenchReport, EngineMetrics, LatencyStats, OursResult
from vllm_actors.bench.throughput_workload import TEMPERATURE, TOKEN_ID_RANGE, Workload

log = structlog.get_logger(__name__)


def make_llm(
    args: argparse.Namespace, model_path: str, load_format: str, enforce_eager: bool, tokenizer: bool = False
) -> Any:
    """``tokenizer``: load the model's tokenizer (structured outputs need it); off by default."""
    from vllm_actors.llm import LLM

    engine_args: dict[str, Any] = {
        "skip_tokenizer_init": not tokenizer, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "seed": args.seed,
        "enforce_eager": enforce_eager, "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
    }
    if not args.enable_prefix_caching:
        engine_args["enable_prefix_caching"] = False
    if getattr(args, "block_size", None) is not None:
        engine_args["block_size"] = args.block_size
    if getattr(args, "max_num_batched_tokens", None) is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if getattr(args, "tensor_parallel_size", 1) > 1:
        engine_args["tensor_parallel_size"] = args.tensor_parallel_size
    stages = getattr(args, "pipeline_parallel_size", 1)
    if stages < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {stages}")
    if stages > 1:  # composes with tensor parallelism: stages x ranks GPUs
        engine_args["pipeline_parallel_size"] = stages
    if getattr(args, "data_parallel_size", 1) > 1:  # only passed when asked: older engines lack the argument
        engine_args["data_parallel_size"] = args.data_parallel_size
        engine_args["routing_policy"] = args.routing_policy
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
        from vllm_actors.observe.tap import save_dump
        from vllm_actors.protocol.metrics import DumpQuery, DumpReply

        query = self.llm.engine.query_metrics
        kwargs = {"timeout_ms": 120_000} if "timeout_ms" in inspect.signature(query).parameters else {}
        reply = query(DumpQuery(), **kwargs)
        if not isinstance(reply, DumpReply):
            raise RuntimeError(f"the metrics store could not dump its event log: {reply!r}")
        reply = save_dump(reply, path.resolve())
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
             output_tokens=workload.output_tokens, runs=max(1, args.runs))
    best = float("inf")
    for _ in range(max(1, getattr(args, "runs", 1))):  # the event-log metrics below are the last run's
        start_wall = time.time()
        outputs, seconds = session.generate(workload.prompts, workload.max_tokens)
        produced = sum(len(output.outputs[0].token_ids) for output in outputs)
        report.ours_runs.append(produced / seconds)
        log.info("timed run done", seconds=round(seconds, 3), tok_s=round(produced / seconds, 1))
        best = min(best, seconds)
    seconds = best
    report.ours = OursResult(
        num_requests=len(workload), prompt_tokens=workload.prompt_tokens, output_tokens=produced,
        expected_output_tokens=workload.output_tokens, seconds=seconds, enforce_eager=args.enforce_eager,
    )
    log.info("timed run done", seconds=round(seconds, 3), tok_s=round(report.ours.tokens_per_s, 1))
    if produced != workload.output_tokens:
        log.warning("output tokens differ from the workload's", produced=produced, expected=workload.output_tokens)
    if getattr(args, "no_events", False):
        return [], start_wall  # no events were published: nothing in the store to analyse

    summary = session.wait_for_store()
    records = read_event_log(session.dump_events(events_dir / "events.jsonl"))
    steps = worker_steps(records, since_wall=start_wall)
    request_ids = {output.request_id for output in outputs}
    ttft, itl, seen = request_latencies(records, request_ids)
    decode_ms = [step["execute_ms"] for step in steps if is_decode_only(step)]
    report.metrics = EngineMetrics(
        idle=decode_idle_share(steps),
        gpu_busy=gpu_busy_shares(records, since_wall=start_wall),
        ttft=ttft,
        itl=itl,
        decode_step_ms=LatencyStats.of(decode_ms),
        num_steps=len(steps),
        num_decode_steps=len(decode_ms),
        events_in_log=len(records),
        log_complete=seen == len(request_ids),
        store_summary={
            "ttft": percentiles_dict(summary.ttft), "itl": percentiles_dict(summary.itl),
            "step_ms": percentiles_dict(summary.step_ms), "steps": summary.steps,
            "generation_tokens": summary.generation_tokens, "preemptions": summary.preemptions,
            "requests_finished": summary.requests_finished,
        },
    )
    if report.metrics.idle is not None:
        log.info("gpu idle between decode steps", share=round(report.metrics.idle.share, 4))
    return steps, start_wall
