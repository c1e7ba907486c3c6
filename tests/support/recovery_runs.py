"""Whole in-process runs with actors replaced mid-run, as the supervisor restarts a crashed process
(the messages queued for it die with it): the workloads, the faults and the recovery each restart
gets in a group (``RecoverPipeline`` after a KV-cache manager or worker restart, the client's
resubmissions after a scheduler restart). Shared by the engine's recovery tests."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.engine.test_scheduler import make_engine
from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.messages import AddRequest, RecoverPipeline
from vllm_actors.protocol.names import KV_CACHE_MANAGER, SCHEDULER, SUPERVISOR, WORKER, child_request_id
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.build import ngram_proposer
from vllm_actors.runner.sampler import Sampler

BLOCK_SIZE = 4
Outcome = dict[str, list[tuple[list[int], str | None, int | str | None]]]


# ------------------------------------------------------------------ workloads
@dataclass
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams


def workload(seed: int, count: int = 14) -> list[Job]:
    """Greedy and seeded requests, some n=2, most sharing one of a few system prompts (prefix-cache
    hits), some stopping on EOS (token 0) or a stop token, long enough to be chunked."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 97) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    jobs = []
    for index in range(count):
        prefix = rng.choice(systems) if rng.random() < 0.7 else []
        prompt = prefix + [rng.randrange(1, 97) for _ in range(rng.randint(1, 30))]
        kind = rng.choice(["greedy", "seeded", "seeded-n2", "greedy-stop"])
        max_tokens = rng.randint(3, 24)
        if kind == "greedy":
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        elif kind == "greedy-stop":
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[rng.randrange(1, 97)],
                                    min_tokens=rng.randint(0, 2))
        else:  # a high temperature: the fake model's one-hot logits leave every token a real chance
            params = SamplingParams(temperature=5.0, seed=rng.randrange(1000), max_tokens=max_tokens,
                                    n=2 if kind == "seeded-n2" else 1)
        jobs.append(Job(f"r{index}", prompt, params))
    return jobs


def outcome(outputs: dict[str, RequestOutput]) -> Outcome:
    return {
        request_id: [(list(o.token_ids), o.finish_reason, o.stop_reason) for o in output.outputs]
        for request_id, output in outputs.items()
    }


Fault = Callable[[InProcessEngine, dict[str, RequestOutput], list[Job]], None]


def run(engine: InProcessEngine, jobs: list[Job], faults: dict[int, Fault] | None = None) -> tuple[Outcome, int]:
    """Submit every job, step to the end, applying ``faults[k]`` after step k. Returns the outcome
    (each request's children: tokens, finish and stop reasons) and the number of steps."""
    faults = faults or {}
    for job in jobs:
        engine.submit(engine.prepare(job.request_id, {"prompt_token_ids": job.prompt}, job.params))
    latest: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished:
        for output in engine.step():
            latest[output.request_id] = output
        steps += 1
        assert steps < 5000, "the engine stalled"
        if steps in faults:
            faults[steps](engine, latest, jobs)
    assert all(output.finished and output.error is None for output in latest.values())
    engine.check_idle_invariants()  # no table left; every block free or idle in the prefix cache
    return outcome(latest), steps


def engine_for(num_blocks: int = 40, **kwargs: Any) -> tuple[InProcessEngine, FakeRunner]:
    """Small pool (preemption), small budget (chunked prefill), prefix caching on."""
    return make_engine(num_blocks=num_blocks, block_size=BLOCK_SIZE, budget=24, **kwargs)


# ------------------------------------------------------------------ faults
def recover(engine: InProcessEngine, actor: str, first: bool) -> None:
    """What the supervisor does once the restarted actor is READY."""
    engine.inject(SCHEDULER, RecoverPipeline(actor=actor, reason="exited"), first=first, sender=SUPERVISOR)


def restart_kv_manager(first: bool = False) -> Fault:
    def fault(engine: InProcessEngine, latest: dict[str, RequestOutput], jobs: list[Job]) -> None:
        old = engine.kv_cache_manager
        engine.replace_actor(KVCacheManager(old.pool.num_blocks, old.block_size))
        recover(engine, KV_CACHE_MANAGER, first)

    return fault


def restart_worker(runner_state: str, first: bool = False) -> Fault:
    """A fresh worker. ``stale``: its runner's KV still holds what the old one wrote (a GPU's
    memory as a new process finds it: whatever it is); ``scrambled``: random garbage."""

    def fault(engine: InProcessEngine, latest: dict[str, RequestOutput], jobs: list[Job]) -> None:
        runner = engine.worker.runner
        if runner_state == "scrambled":
            assert isinstance(runner, FakeRunner)
            fresh = FakeRunner(num_blocks=runner.num_blocks, block_size=runner.block_size)
            rng = random.Random(len(latest))
            fresh.slots = [rng.randrange(97) for _ in fresh.slots]
            runner = fresh
        engine.replace_actor(Worker(runner, Sampler(runner.device, engine.config.seed), clock=time.perf_counter,
                                    drafter=ngram_proposer(engine.config)))  # as build_worker's
        recover(engine, WORKER, first)

    return fault


def resubmissions(engine: InProcessEngine, latest: dict[str, RequestOutput], jobs: list[Job]) -> list[AddRequest]:
    """What a client sends a restarted scheduler: every unfinished engine request (an n>1 child
    each), with the output tokens it has received."""
    adds = []
    for job in jobs:
        output = latest.get(job.request_id)
        if output is not None and output.finished:
            continue
        for index in range(job.params.n):
            child = output.outputs[index] if output is not None else None
            if child is not None and child.finish_reason is not None:
                continue
            params = job.params
            if params.n > 1 and params.seed is not None:
                params = params.clone(seed=params.seed + index)  # as the frontend fans out
            adds.append(
                AddRequest(
                    request_id=job.request_id if job.params.n == 1 else child_request_id(job.request_id, index),
                    prompt_token_ids=job.prompt,
                    params=params,
                    eos_token_ids=engine.frontend.eos_token_ids,
                    resume=True,
                    output_token_ids=list(child.token_ids) if child is not None else [],
                )
            )
    return adds


def restart_scheduler(duplicates: bool = False) -> Fault:
    def fault(engine: InProcessEngine, latest: dict[str, RequestOutput], jobs: list[Job]) -> None:
        engine.replace_actor(Scheduler(engine.scheduler_config))
        for output in engine.receive_pending():  # the dead scheduler's last updates, received first
            latest[output.request_id] = output
        adds = resubmissions(engine, latest, jobs)
        for add in adds:
            engine.inject(SCHEDULER, add)
        if duplicates:  # the client sends again (the original may still be queued): ignored
            for add in adds:
                engine.inject(SCHEDULER, add)

    return fault

FAULTS: dict[str, Callable[[], Fault]] = {
    "kv-manager": restart_kv_manager,
    "kv-manager-recover-first": lambda: restart_kv_manager(first=True),
    "worker-stale": lambda: restart_worker("stale"),
    "worker-scrambled": lambda: restart_worker("scrambled", first=True),
    "scheduler": restart_scheduler,
    "scheduler-duplicates": lambda: restart_scheduler(duplicates=True),
}

