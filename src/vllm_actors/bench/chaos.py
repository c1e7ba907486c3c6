"""``vllm-actors chaos``: kill actors of a serving group under load and check that no request is lost.

Starts a process group (default: the embedded default model on CPU; ``--model``), runs a
fault-free reference pass over the prompts, then for ``--duration`` seconds a streamed load
through ``AsyncEngineClient`` (``--concurrency`` requests at a time; even prompts greedy, odd ones
seeded sampling; EOS ignored, so every output has ``--max-tokens`` tokens) while, every
``--kill-every`` seconds on average (exponential gaps), a random actor of ``--actors`` gets
SIGKILL - or SIGSTOP with probability ``--stop-prob`` (a hang for the supervisor's liveness
check; ``--stop-seconds`` sends SIGCONT after that long, 0: never). Pids come from
``ProcessGroup.pids()``, read at each fault, so a restarted actor is found again.

Then: each request's outcome (completed, recovered across a fault, failed, hung, lost; outputs
that differ from the reference), each fault's recovery time (from the signal to the
supervisor's ACTOR_RESTARTED for that actor, read on the bus) and the KV blocks still in use once
the group is idle (``kv_blocks_in_use`` of the metrics store's summary: should be 0). Printed as a
table, and as JSON with ``--json PATH``. Exit status 0 when clean, 1 otherwise.

The classification and the report are in ``chaos_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio

from vllm_actors.bench.chaos_report import ChaosReport, Fault, RequestRun, Restart, build_report, format_table
from vllm_actors.clients.async_health import follow_bus
from vllm_actors.protocol.events import ActorRestarted, EventBatch, GroupFailed, PipelineReset
from vllm_actors.protocol.names import SCHEDULER, SUPERVISOR
from vllm_actors.protocol.sampling import SamplingParams

log = structlog.get_logger(__name__)

DEFAULT_ACTORS = ("worker-0", "kv_cache_manager", "scheduler", "bus", "metrics")
WORDS = ("river stone light window garden morning paper engine silver orange quiet north city field music "
         "winter bridge letter forest station").split()


@dataclass
class ChaosOptions:
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    supervision: dict[str, Any] = field(default_factory=dict)  # ProcessGroup's restart and liveness knobs
    duration: float = 60.0
    kill_every: float = 15.0  # mean seconds between faults; 0: no faults
    actors: tuple[str, ...] = DEFAULT_ACTORS
    stop_prob: float = 0.0
    stop_seconds: float = 0.0
    concurrency: int = 8
    num_prompts: int = 32
    max_tokens: int = 64
    hang_timeout: float = 60.0
    idle_timeout: float = 30.0
    reference: bool = True
    seed: int = 0
    json_path: str | None = None


# --------------------------------------------------------------------------- arguments
def add_chaos_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_actors.engine_args import add_engine_arguments
    from vllm_actors.server.args import add_supervision_arguments

    add_engine_arguments(parser)  # with --load-format (dummy: random weights of the checkpoint's shape)
    add_supervision_arguments(parser)
    parser.set_defaults(device="cpu")  # the default model on CPU; --device auto or cuda for a GPU
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load under faults")
    parser.add_argument("--kill-every", type=float, default=15.0,
                        help="mean seconds between faults (exponential gaps); 0: no faults")
    parser.add_argument("--actors", default=",".join(DEFAULT_ACTORS),
                        help="comma-separated actors to pick from (ids of ProcessGroup.pids())")
    parser.add_argument("--stop-prob", type=float, default=0.0, help="probability of SIGSTOP instead of SIGKILL")
    parser.add_argument("--stop-seconds", type=float, default=0.0,
                        help="SIGCONT a stopped actor after this long (0: never; the supervisor kills it)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at a time")
    parser.add_argument("--num-prompts", type=int, default=32, help="distinct prompts, used round-robin")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    parser.add_argument("--hang-timeout", type=float, default=60.0,
                        help="a request with no output for this long counts as hung (and is aborted)")
    parser.add_argument("--idle-timeout", type=float, default=30.0,
                        help="after the load: how long to wait for the group to be idle before reading the KV gauge")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the fault-free reference pass (no output comparison)")
    parser.add_argument("--chaos-seed", dest="chaos_seed", type=int, default=0, help="seed of the faults and prompts")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the report as JSON")


def options_from_args(args: argparse.Namespace) -> ChaosOptions:
    from vllm_actors.engine_args import engine_kwargs
    from vllm_actors.server.args import supervision_kwargs

    actors = tuple(name.strip() for name in args.actors.split(",") if name.strip())
    options = ChaosOptions(
        model=args.model, engine=engine_kwargs(args),
        supervision=supervision_kwargs(args), duration=args.duration, kill_every=args.kill_every,
        actors=actors, stop_prob=args.stop_prob, stop_seconds=args.stop_seconds, concurrency=args.concurrency,
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, hang_timeout=args.hang_timeout,
        idle_timeout=args.idle_timeout, reference=args.reference, seed=args.chaos_seed, json_path=args.json_path,
    )
    validate(options)
    return options


def validate(options: ChaosOptions) -> None:
    checks = (
        (options.duration > 0, "--duration must be positive"),
        (options.kill_every >= 0, "--kill-every must be >= 0"),
        (0.0 <= options.stop_prob <= 1.0, "--stop-prob must be within [0, 1]"),
        (options.stop_seconds >= 0, "--stop-seconds must be >= 0"),
        (options.concurrency >= 1, "--concurrency must be at least 1"),
        (options.num_prompts >= 1, "--num-prompts must be at least 1"),
        (options.max_tokens >= 1, "--max-tokens must be at least 1"),
        (options.hang_timeout > 0, "--hang-timeout must be positive"),
        (bool(options.actors) or options.kill_every == 0, "--actors names no actor"),
    )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-actors bench chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_chaos_arguments(parser)
    return parser


# --------------------------------------------------------------------------- the workload
def make_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{index}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for index in range(count)]


def sampling_for(prompt_index: int, max_tokens: int, seed: int) -> SamplingParams:
    """Even prompts greedy, odd ones seeded sampling: both reproducible, also across a recompute."""
    if prompt_index % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed * 1_000_003 + prompt_index, max_tokens=max_tokens,
                          ignore_eos=True)


def next_fault_delay(rng: random.Random, kill_every: float) -> float:
    return rng.expovariate(1.0 / kill_every)


def pick_fault(rng: random.Random, actors: tuple[str, ...], stop_prob: float) -> tuple[str, signal.Signals]:
    actor = rng.choice(actors)
    return actor, (signal.SIGSTOP if rng.random() < stop_prob else signal.SIGKILL)


# --------------------------------------------------------------------------- the run
class ChaosRun:
    def __init__(self, client: Any, options: ChaosOptions) -> None:
        self.client = client
        self.options = options
        self.prompts = make_prompts(options.num_prompts, options.seed)
        self.runs: list[RequestRun] = []
        self.faults: list[Fault] = []
        self.restarts: list[Restart] = []
        self.group_failed: str | None = None
        self.pipeline_resets = 0
        self.skipped_faults = 0
        self._ids = itertools.count()

    async def one_request(self, prompt_index: int, tag: str) -> RequestRun:
        request_id = f"{tag}-{next(self._ids)}-p{prompt_index}"
        run = RequestRun(request_id=request_id, prompt_index=prompt_index, start=time.monotonic())
        params = sampling_for(prompt_index, self.options.max_tokens, self.options.seed)
        try:
            stream = self.client.add_request(request_id, self.prompts[prompt_index], params)
        except Exception as error:  # refused at once (e.g. the group failed)
            run.error, run.end = f"{type(error).__name__}: {error}", time.monotonic()
            return run
        run.last_progress = run.start
        try:
            while True:
                try:
                    output = await asyncio.wait_for(stream.__anext__(), self.options.hang_timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    run.hung = True
                    stream.abort("abort")
                    break
                run.last_progress = time.monotonic()
                completion = output.outputs[0]
                run.token_ids = list(completion.token_ids)
                if output.finished:
                    run.finish_reason = completion.finish_reason
                    run.end = run.last_progress
                    break
        except Exception as error:
            run.error, run.end = f"{type(error).__name__}: {error}", time.monotonic()
        return run

    async def load(self, deadline: float, tag: str, indices: list[int] | None = None) -> list[RequestRun]:
        """``concurrency`` workers: every prompt once (``indices``) or round-robin until ``deadline``."""
        counter = itertools.count()
        runs: list[RequestRun] = []

        async def worker() -> None:
            while True:
                number = next(counter)
                if indices is not None:
                    if number >= len(indices):
                        return
                    prompt_index = indices[number]
                elif time.monotonic() >= deadline:
                    return
                else:
                    prompt_index = number % len(self.prompts)
                if self.group_failed is not None or getattr(self.client, "failed", None) is not None:
                    return  # the group gave up: every later request would fail at once
                runs.append(await self.one_request(prompt_index, tag))

        await asyncio.gather(*(worker() for _ in range(self.options.concurrency)))
        return runs

    async def reference(self) -> dict[int, list[int]]:
        runs = await self.load(float("inf"), "ref", list(range(len(self.prompts))))
        bad = [run for run in runs if run.outcome != "completed"]
        if bad:
            raise RuntimeError(f"the fault-free reference pass did not complete: {bad[0]}")
        return {run.prompt_index: run.token_ids for run in runs}

    async def inject_faults(self, deadline: float) -> None:
        options = self.options
        if options.kill_every <= 0:
            return
        rng = random.Random(options.seed + 1)
        group = self.client.group
        while True:
            delay = next_fault_delay(rng, options.kill_every)
            if time.monotonic() + delay >= deadline:
                return
            await asyncio.sleep(delay)
            actor, how = pick_fault(rng, options.actors, options.stop_prob)
            pid = group.pids().get(actor)
            if pid is None or not group.alive().get(actor, True):
                self.skipped_faults += 1  # down (not restarted yet, or for good): nothing to kill
                continue
            try:
                os.kill(pid, how)
            except ProcessLookupError:
                continue
            stall = how is signal.SIGSTOP and options.stop_seconds > 0
            self.faults.append(Fault(actor=actor, pid=pid, signal=how.name, at=time.monotonic(),
                                     continued_after=options.stop_seconds if stall else None))
            log.info("fault", actor=actor, pid=pid, signal=how.name)
            if stall:
                asyncio.get_running_loop().call_later(options.stop_seconds, _continue, pid)

    async def follow_bus(self, address: str) -> None:
        """The supervisor's ACTOR_RESTARTED / GROUP_FAILED and the scheduler's PIPELINE_RESET."""
        context = zmq.asyncio.Context()
        try:
            async for _, batch in follow_bus(context, address, self.client.keys, [SUPERVISOR, SCHEDULER]):
                self.on_batch(batch)
        finally:
            context.term()

    def on_batch(self, batch: EventBatch) -> None:
        for event in batch.events:
            if batch.actor == SUPERVISOR and isinstance(event, ActorRestarted):
                self.restarts.append(Restart(actor=event.actor, pid=event.pid, attempt=event.attempt,
                                             seconds=event.seconds, at=batch.mono))
            elif batch.actor == SUPERVISOR and isinstance(event, GroupFailed):
                self.group_failed = event.reason
            elif batch.actor == SCHEDULER and isinstance(event, PipelineReset):
                self.pipeline_resets += 1

    async def idle_kv(self) -> tuple[int | None, int | None]:
        """``kv_blocks_in_use`` / ``kv_blocks_total`` once nothing runs or waits (None: no answer)."""
        deadline = time.monotonic() + self.options.idle_timeout
        reply = None
        while time.monotonic() < deadline:
            try:
                reply = await self.client.get_metrics()
            except Exception:  # the store restarting: ask again
                reply = None
            if reply is not None and reply.running == 0 and reply.waiting == 0 and reply.kv_blocks_in_use == 0:
                break
            await asyncio.sleep(0.5)
        return (None, None) if reply is None else (reply.kv_blocks_in_use, reply.kv_blocks_total)


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


async def run_chaos(options: ChaosOptions, client: Any | None = None) -> ChaosReport:
    """Start a group (or use ``client``, an ``AsyncEngineClient`` that owns one), run, report."""
    from vllm_actors.clients.async_client import AsyncEngineClient

    owned = client is None
    if client is None:
        client = await AsyncEngineClient.start(options.model, supervision=options.supervision, **options.engine)
    try:
        if client.group is None:
            raise ValueError("the chaos run needs a client that owns its process group (for the pids)")
        unknown = sorted(set(options.actors) - set(client.group.pids())) if options.kill_every > 0 else []
        if unknown:
            raise ValueError(f"unknown actors {unknown}; the group has {sorted(client.group.pids())}")
        chaos = ChaosRun(client, options)
        reference = await chaos.reference() if options.reference else None
        follower = asyncio.get_running_loop().create_task(chaos.follow_bus(client.info.addresses.bus_out))
        await asyncio.sleep(0.2)  # let the subscription reach the bus
        started = time.monotonic()
        deadline = started + options.duration
        faults = asyncio.get_running_loop().create_task(chaos.inject_faults(deadline))
        chaos.runs = await chaos.load(deadline, "chaos")
        ended = time.monotonic()
        await faults
        kv_in_use, kv_total = await chaos.idle_kv()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        return build_report(chaos.runs, chaos.faults, chaos.restarts, reference, started=started, ended=ended,
                            kv_blocks_in_use=kv_in_use, kv_blocks_total=kv_total, group_failed=chaos.group_failed,
                            pipeline_resets=chaos.pipeline_resets, skipped_faults=chaos.skipped_faults)
    finally:
        if owned:
            await client.shutdown()


def run_from_args(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    report = asyncio.run(run_chaos(options))
    sys.stdout.write(format_table(report) + "\n")
    if options.json_path:
        with open(options.json_path, "w", encoding="utf-8") as handle:
            json.dump(report.to_json(), handle, indent=2)
            handle.write("\n")
    return 0 if report.clean else 1


def main(argv: list[str] | None = None) -> int:
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return run_from_args(args)
    except (ValueError, FileNotFoundError, TimeoutError) as error:
        sys.stderr.write(f"error: {error}\n")
        return 2
