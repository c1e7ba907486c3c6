"""Recovery inside the state machines ("let it crash"), driven in process.

An actor of the step pipeline is replaced by a fresh one in the middle of a run, as the supervisor
restarts a crashed process (the messages queued for it die with it), and recovered as in a group:
``RecoverPipeline`` to the scheduler after a KV-cache manager or worker restart; the client's
resubmissions (``AddRequest.resume`` with the tokens it received) after a scheduler restart. Every
output must be identical to the run without a fault: requests resume by recompute, and greedy and
seeded sampling depend only on (seed, position). The fake runner reads its "KV" back through the
block tables, so a request resumed on a wrong or stale block shows in its tokens; invariants (the
scheduler's ledger and the KV manager each add up and agree) are checked after every step, and the
pool must be fully free (or idle in the prefix cache) at the end.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from tests.engine.test_engine_prefix_caching import record_events
from tests.engine.test_scheduler import make_engine, record_plans
from tests.support.fake_runner import FakeRunner
from tests.support.outputs import pairs
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import (
    Aborted,
    BlockEvicted,
    Finished,
    Freed,
    KvPool,
    PipelineReset,
    Preempted,
    Queued,
    Resumed,
)
from vllm_actors.protocol.messages import (
    AddRequest,
    NewRequest,
    PassThroughPlan,
    RecoverPipeline,
    RequestUpdates,
    StepPlan,
    StepResult,
    pack_token_ids,
)
from vllm_actors.protocol.names import FRONTEND, KV_CACHE_MANAGER, SCHEDULER, SUPERVISOR, WORKER, child_request_id
from vllm_actors.protocol.outputs import Outputs
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


# ------------------------------------------------------------------ whole runs
FAULTS: dict[str, Callable[[], Fault]] = {
    "kv-manager": restart_kv_manager,
    "kv-manager-recover-first": lambda: restart_kv_manager(first=True),
    "worker-stale": lambda: restart_worker("stale"),
    "worker-scrambled": lambda: restart_worker("scrambled", first=True),
    "scheduler": restart_scheduler,
    "scheduler-duplicates": lambda: restart_scheduler(duplicates=True),
}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_outputs_are_identical_after_a_restart_in_the_middle_of_a_run(fault: str, seed: int) -> None:
    jobs = workload(seed)
    engine, _ = engine_for()
    expected, steps = run(engine, jobs)
    assert engine.scheduler.stats.num_preemptions > 0 and engine.scheduler.stats.num_prefill_chunks > 0
    rng = random.Random(seed * 100 + len(fault))
    at = sorted(rng.sample(range(2, steps - 1), 2))  # two faults, somewhere in the run
    engine, _ = engine_for()
    events = record_events(engine)
    got, _ = run(engine, jobs, {k: FAULTS[fault]() for k in at})
    assert got == expected
    resets = [event for event in events if isinstance(event, PipelineReset)]
    if fault.startswith("scheduler"):
        assert not resets  # a new scheduler resets with its first plan, nothing to preempt
        resumed = {event.request_id for event in events if isinstance(event, Resumed)}
        assert resumed, "resubmitted requests with outputs resume (RESUMED)"
    else:
        assert len(resets) == 2 and engine.scheduler.stats.num_resets == 2
        actor = KV_CACHE_MANAGER if fault.startswith("kv") else WORKER
        assert all(reset.reason == f"{actor}: exited" for reset in resets)
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks + manager.num_idle_cached_blocks == manager.pool.num_blocks


def test_a_fault_on_every_step_of_a_short_run_still_gives_the_same_outputs() -> None:
    """Restarts back to back, alternating the actor, one after every step: a reset while the
    previous reset plan is still in flight, requests preempted before they computed anything."""
    jobs = workload(4, count=6)
    engine, _ = engine_for(num_blocks=60)
    expected, steps = run(engine, jobs)
    cycle = [restart_kv_manager(), restart_worker("scrambled"), restart_scheduler(), restart_kv_manager(True)]
    engine, _ = engine_for(num_blocks=60)
    got, _ = run(engine, jobs, {k: cycle[k % len(cycle)] for k in range(1, 3 * steps)})
    assert got == expected


def test_a_recovery_with_nothing_running_resets_the_idle_pipeline() -> None:
    engine, runner = engine_for()
    events = record_events(engine)
    prompt = list(range(1, 30))
    expected, _ = run(engine, [Job("a", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    num_cached = len(engine.kv_cache_manager.cached)
    # 32 computed tokens (29 + 4 - 1), 8 full blocks: 7 stay cached, idle. The last block's last
    # token is the third output, known only after the last step was planned (two in flight).
    assert num_cached == 7
    engine.replace_actor(Worker(runner, Sampler(runner.device, 0), clock=time.perf_counter))
    recover(engine, WORKER, first=False)
    engine.run_until_idle()
    assert [e.num_preempted for e in events if isinstance(e, PipelineReset)] == [0]
    # The worker's KV is gone: the KV manager dropped its cache too (BLOCK_EVICTED, deepest first).
    assert not engine.kv_cache_manager.cached and engine.kv_cache_manager.num_free_blocks == 40
    evicted = [e for e in events if isinstance(e, BlockEvicted)][-1]
    assert len(evicted.block_hashes) == num_cached and evicted.parent_hashes[-1] == 0
    last_pool = [e for e in events if isinstance(e, KvPool)][-1]
    assert last_pool == KvPool(num_blocks=40, num_free=40, num_cached=0, num_cached_idle=0, num_in_use=0)
    again, _ = run(engine, [Job("b", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    assert again["b"] == expected["a"]


# ------------------------------------------------------------------ the scheduler, driven directly
def scheduler(num_blocks: int = 100, **overrides: Any) -> Scheduler:
    config = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  block_size=4, num_blocks=num_blocks, max_steps_in_flight=2)
    return Scheduler(SchedulerConfig(**{**config, **overrides}))  # type: ignore[arg-type]


def add(request_id: str, prompt: list[int], outputs: list[int] | None = None, resume: bool = False,
        **params: Any) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=prompt, eos_token_ids=[0],
                      params=SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}),
                      resume=resume or outputs is not None, output_token_ids=outputs or [])


def plans_of(out: Outputs) -> list[StepPlan]:
    return [message for _, message in pairs(out) if isinstance(message, StepPlan)]


def updates_of(out: Outputs) -> list[Any]:
    return [u for destination, m in pairs(out) if destination == FRONTEND and isinstance(m, RequestUpdates)
            for u in m.updates]


def events_of(out: Outputs | list[tuple[str, Any]], kind: type) -> list[Any]:
    return [message for _, message in pairs(out) if isinstance(message, kind)]


def ignored(out: Outputs) -> bool:
    """Nothing for the client and no request event: the message changed nothing (the scheduler
    may still send its next plan, a step being back in flight)."""
    return not updates_of(out) and not any(isinstance(m, (Queued, Aborted, Resumed, Finished)) for _, m in pairs(out))


def result_of(plan: StepPlan, token: int = 5) -> StepResult:
    """What a worker returns for a plan whose requests all sample."""
    return StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=list(plan.req_ids),
                      token_ids=[token] * len(plan.req_ids))


def test_a_new_schedulers_first_plan_resets_the_pipeline_and_only_that_one() -> None:
    s = scheduler()
    first, second = plans_of(s.handle(add("a", [1, 2, 3])))  # the prefill, then the next decode
    assert first.reset and not second.reset
    (third,) = plans_of(s.handle(result_of(first)))
    assert not third.reset


def test_recover_pipeline_preempts_running_requests_in_order_and_keeps_waiting_ones() -> None:
    s = scheduler(max_num_seqs=3, max_steps_in_flight=1)
    (plan0,) = plans_of(s.handle(add("a", [1] * 9)))
    for request_id in ("b", "c", "d"):
        s.handle(add(request_id, [2] * 6 + [ord(request_id)]))
    (plan1,) = plans_of(s.handle(result_of(plan0)))  # a decodes; b and c join; d waits (max_num_seqs)
    assert [r.request_id for r in s.running] == ["a", "b", "c"] and [r.request_id for r in s.waiting] == ["d"]
    out = s.handle(RecoverPipeline(actor=WORKER, reason="hung"))
    preempted = events_of(out, Preempted)
    assert [e.request_id for e in preempted] == ["a", "b", "c"]
    assert events_of(out, PipelineReset) == [PipelineReset(reason="worker: hung", num_preempted=3)]
    (plan2,) = plans_of(out)
    assert plan2.reset and plan2.step_id > plan1.step_id and not plan2.finished_ids and not plan2.evicted_hashes
    # Resumed by recompute, in their order: prompt and outputs, from the first token.
    news = {new.request_id: new for new in plan2.new_requests}
    assert [new.request_id for new in plan2.new_requests] == ["a", "b", "c"]
    assert news["a"].token_list() == [1] * 9 + [5] and news["a"].num_output_tokens == 1
    assert news["a"].num_cached_tokens == 0  # the prefix cache is empty: its blocks are gone
    assert [r.request_id for r in s.waiting] == ["d"]
    assert {r.request_id: r.num_pending for r in s.requests.values()} == {"a": 1, "b": 1, "c": 1, "d": 0}
    # The stale result of plan 1 (and a reset-less one for plan 2) are ignored, not errors.
    assert ignored(s.handle(result_of(plan1)))
    assert ignored(s.handle(StepResult(step_id=plan2.step_id, req_ids=[], token_ids=[])))
    assert s.stats.num_stale_results == 2
    out = s.handle(result_of(plan2, token=7))
    assert {u.request_id: u.new_token_ids for u in updates_of(out)} == {"a": [7], "b": [7], "c": [7]}
    s.ledger.check_invariants({r.request_id for r in s.running})


def test_a_request_whose_token_is_in_flight_at_the_reset_samples_it_again() -> None:
    s = scheduler(max_steps_in_flight=2)
    plan0, plan1 = plans_of(s.handle(add("a", [1, 2, 3, 4, 5])))  # plan 1 samples its second token
    (plan2,) = plans_of(s.handle(result_of(plan0)))  # and plan 2 its third
    assert s.requests["a"].num_pending == 2 and s.requests["a"].output_token_ids == [5]
    plan3, plan4 = plans_of(s.handle(RecoverPipeline(actor=KV_CACHE_MANAGER, reason="exited")))
    request = s.requests["a"]
    assert plan3.reset and not plan4.reset and plan4.req_ids == ["a"] and not plan4.new_requests
    assert request.num_pending == 2 and request.output_token_ids == [5]  # plans 3 and 4, not 1 and 2
    assert plan3.new_requests[0].token_list() == [1, 2, 3, 4, 5, 5]  # the lost tokens are not there
    assert ignored(s.handle(result_of(plan1))) and ignored(s.handle(result_of(plan2)))
    out = s.handle(result_of(plan3, token=9))
    assert [u.new_token_ids for u in updates_of(out)] == [[9]] and request.output_token_ids == [5, 9]


def test_a_reset_in_the_middle_of_a_chunked_prefill_starts_it_over() -> None:
    s = scheduler(max_num_batched_tokens=8, max_steps_in_flight=1)
    (plan0,) = plans_of(s.handle(add("a", list(range(1, 21)))))
    assert plan0.num_tokens == [8]
    (plan1,) = plans_of(s.handle(StepResult(step_id=plan0.step_id, reset=True, req_ids=[], token_ids=[])))
    out = s.handle(RecoverPipeline(actor=WORKER, reason="exited"))
    assert [e.num_computed_tokens for e in events_of(out, Preempted)] == [16]
    (plan2,) = plans_of(out)
    assert plan2.reset and plan2.num_tokens == [8] and plan2.new_requests[0].num_output_tokens == 0


def test_n2_children_are_preempted_and_resumed_each_on_its_own() -> None:
    s = scheduler()
    for index in range(2):
        s.handle(add(child_request_id("r", index), [3, 4, 5], seed=7 + index, temperature=1.0))
    plan = plans_of(s.handle(RecoverPipeline(actor=WORKER, reason="exited")))[0]
    assert plan.reset and {n.request_id for n in plan.new_requests} == {"r#0", "r#1"}


def test_a_resubmission_resumes_with_its_outputs_counted_for_seeded_sampling() -> None:
    s = scheduler()
    out = s.handle(add("a", [1, 2, 3], outputs=[7, 8], seed=3, temperature=1.0))
    plan = plans_of(out)[0]
    new: NewRequest = plan.new_requests[0]
    assert plan.reset and new.token_list() == [1, 2, 3, 7, 8]
    assert (new.num_prompt_tokens, new.num_output_tokens) == (3, 2)
    assert events_of(out, Resumed) and not updates_of(out)
    out = s.handle(result_of(plan, token=9))
    assert [u.new_token_ids for u in updates_of(out)] == [[9]]
    assert s.requests["a"].output_token_ids == [7, 8, 9]


def test_a_duplicate_resubmission_is_ignored_silently_and_one_lacking_tokens_gets_them() -> None:
    """A resubmission of a request the scheduler holds: with the tokens it has, nothing to say;
    with fewer (its sender missed some: a replica set's new controller), the missing ones from where
    the sender's end (``catch_up``), the request itself unchanged."""
    s = scheduler()
    plans_of(s.handle(add("a", [1, 2, 3], outputs=[4])))
    assert ignored(s.handle(add("a", [1, 2, 3], outputs=[4], resume=True)))
    (update,) = updates_of(s.handle(add("a", [1, 2, 3], resume=True)))
    assert (update.new_token_ids, update.output_index, update.finish_reason) == ([4], 0, None)
    assert ignored(s.handle(add("a", [1, 2, 3], outputs=[9], resume=True)))  # not this copy's history
    assert s.requests["a"].output_token_ids == [4]
    # A plain AddRequest for an id in use is still an error.
    (update,) = updates_of(s.handle(add("a", [1, 2, 3])))
    assert update.finish_reason == "error" and "already in use" in (update.error or "")


@pytest.mark.parametrize(
    ("outputs", "params", "reason", "stop_reason"),
    [
        ([5, 6, 7], dict(max_tokens=3), "length", None),
        ([5, 0], dict(max_tokens=8), "stop", None),  # EOS
        ([5, 0], dict(max_tokens=8, min_tokens=2), "stop", None),
        ([5, 42], dict(max_tokens=8, stop_token_ids=[42]), "stop", 42),
        ([5] * 61, dict(max_tokens=None), "length", None),  # 3 + 61 == max_model_len
    ],
)
def test_a_resubmission_whose_outputs_already_end_it_finishes_at_once(
    outputs: list[int], params: dict[str, Any], reason: str, stop_reason: int | None
) -> None:
    s = scheduler()
    out = s.handle(add("a", [1, 2, 3], outputs=outputs, **params))
    (update,) = updates_of(out)
    assert (update.finish_reason, update.stop_reason, update.new_token_ids) == (reason, stop_reason, [])
    (finished,) = events_of(out, Finished)
    assert (finished.reason, finished.num_output_tokens) == (reason, len(outputs))
    assert "a" not in s.requests and not s.waiting


@pytest.mark.parametrize(
    ("outputs", "params"),
    [
        ([5, 0], dict(min_tokens=3)),  # EOS before min_tokens: it was masked, cannot end it
        ([5, 0], dict(ignore_eos=True)),
        ([5, 42], dict(stop_token_ids=[42], min_tokens=3)),
    ],
)
def test_a_resubmission_whose_stop_token_came_before_min_tokens_goes_on(outputs: list[int],
                                                                        params: dict[str, Any]) -> None:
    s = scheduler()
    out = s.handle(add("a", [1, 2, 3], outputs=outputs, **params))
    assert not updates_of(out) and events_of(out, Queued) and plans_of(out)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (add("a", [1, 2], outputs=[-1]), "output token ids must lie in"),
        (add("a", [1, 2], outputs=[2**31]), "output token ids must lie in"),
        (add("a", [1] * 40, outputs=[1] * 30), "max_model_len (64)"),
        (add("a", [1, 2], outputs=[1] * 9), "more than max_tokens (8)"),
        (AddRequest(request_id="a", prompt_token_ids=[1], params=SamplingParams(), eos_token_ids=[0],
                    output_token_ids=[3]), "only taken with resume=True"),
        (add("a", [], outputs=[3]), "the prompt is empty"),
    ],
)
def test_bad_resubmissions_get_a_clear_error(message: AddRequest, error: str) -> None:
    s = scheduler()
    (update,) = updates_of(s.handle(message))
    assert update.finish_reason == "error" and error in (update.error or ""), update.error
    assert "a" not in s.requests


def test_a_new_scheduler_ignores_results_of_its_predecessors_plans() -> None:
    """Step ids start at 0 again: the old pipeline's result for its step 0 must not pass for the
    new reset plan's (only ``StepResult.reset`` tells them apart)."""
    s = scheduler()
    # The first message of a new scheduler may well be a result from the old pipeline: ignored,
    # and the (empty) reset plan goes out at once, to clear what the pipeline still holds.
    (reset,) = plans_of(s.handle(StepResult(step_id=0, req_ids=["a"], token_ids=[1])))
    assert reset.step_id == 0 and reset.reset and not reset.req_ids
    assert ignored(s.handle(StepResult(step_id=0, req_ids=["a"], token_ids=[1])))  # the predecessor's
    (plan,) = plans_of(s.handle(add("a", [1, 2, 3], resume=True)))
    assert plan.step_id == 1 and not plan.reset
    assert ignored(s.handle(StepResult(step_id=1, req_ids=["a"], token_ids=[1])))  # still the predecessor's
    assert ignored(s.handle(result_of(reset)))
    out = s.handle(result_of(plan, token=4))
    assert [u.new_token_ids for u in updates_of(out)] == [[4]]
    assert s.stats.num_stale_results == 3


def test_results_below_the_last_reset_stay_ignored_once_the_pipeline_runs_again() -> None:
    s = scheduler(max_steps_in_flight=1)
    (plan0,) = plans_of(s.handle(add("a", [1, 2, 3])))
    (plan1,) = plans_of(s.handle(result_of(plan0)))
    (plan2,) = plans_of(s.handle(RecoverPipeline(actor=WORKER, reason="exited")))
    (plan3,) = plans_of(s.handle(result_of(plan2)))
    assert ignored(s.handle(result_of(plan1)))  # a late straggler from the dead worker
    assert updates_of(s.handle(result_of(plan3)))


def test_a_second_reset_while_the_first_reset_plan_is_in_flight() -> None:
    s = scheduler()
    s.handle(add("a", [1, 2, 3]))
    first = plans_of(s.handle(RecoverPipeline(actor=WORKER, reason="exited")))[0]
    second = plans_of(s.handle(RecoverPipeline(actor=KV_CACHE_MANAGER, reason="hung")))[0]
    assert first.reset and second.reset and second.step_id > first.step_id
    assert ignored(s.handle(result_of(first)))  # a reset result, but of the older reset plan
    assert [u.new_token_ids for u in updates_of(s.handle(result_of(second)))] == [[5]]


# ------------------------------------------------------------------ KV-cache manager and worker
def new_request(request_id: str, tokens: list[int]) -> NewRequest:
    return NewRequest(request_id=request_id, token_ids=pack_token_ids(tokens), num_prompt_tokens=len(tokens),
                      num_output_tokens=0, params=SamplingParams(max_tokens=4), eos_token_ids=[0])


def test_kv_manager_reset_drops_everything_and_forwards_the_reset() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 11))
    first, second = 11, 22  # hashes are labels here: the manager checks only their chain
    manager.handle(StepPlan(step_id=0, new_requests=[new_request("a", tokens)], req_ids=["a"], num_tokens=[10],
                            num_blocks=[3], cached_hashes={"a": [first, second]}))
    manager.handle(StepPlan(step_id=1, new_requests=[new_request("b", [9] * 5)], req_ids=["b"], num_tokens=[5],
                            num_blocks=[2]))
    assert manager.pool.num_free == 11
    # Stale plans (below the last reset) are dropped unapplied, once a reset was seen.
    reset = StepPlan(step_id=5, reset=True, new_requests=[new_request("a", tokens)], req_ids=["a"],
                     num_tokens=[10], num_blocks=[3])
    out = manager.handle(reset)
    forwarded = out.to(WORKER)
    assert len(forwarded) == 1 and forwarded[0].reset and forwarded[0].new_block_ids == [[0, 1, 2]]
    assert [d for d, _ in out.messages] == [WORKER]
    events = out.events
    assert sorted(e.request_id for e in events if isinstance(e, Freed)) == ["a", "b"]
    (evicted,) = [e for e in events if isinstance(e, BlockEvicted)]
    assert evicted.block_hashes == [second, first] and evicted.parent_hashes == [first, 0]  # deepest first
    pools = [e for e in events if isinstance(e, KvPool)]
    assert pools[0] == KvPool(num_blocks=16, num_free=16, num_cached=0, num_cached_idle=0, num_in_use=0)
    assert pools[-1].num_free == 13
    assert set(manager.block_tables) == {"a"} and not manager.cached
    manager.check_invariants({"a"})
    assert manager.handle(StepPlan(step_id=4, finished_ids=["a"])) == Outputs()  # planned before the reset
    assert manager.block_tables["a"] == [0, 1, 2]


def test_kv_manager_rejects_a_bad_reset_plan_without_dropping_anything() -> None:
    from vllm_actors.protocol.errors import MessageRejected

    manager = KVCacheManager(num_blocks=4, block_size=4)
    manager.handle(StepPlan(step_id=0, new_requests=[new_request("a", [1] * 6)], req_ids=["a"], num_tokens=[6],
                            num_blocks=[2]))
    with pytest.raises(MessageRejected):
        manager.handle(StepPlan(step_id=1, reset=True, req_ids=["a"], num_tokens=[1], num_blocks=[2]))
    assert manager.block_tables == {"a": [0, 1]}


def test_kv_manager_resets_on_its_pass_through_view_too() -> None:
    """Over the wire the manager decodes plans as ``PassThroughPlan``: ``reset`` survives it and
    the forwarded plan, re-encoded, still carries it and the sampling parameters."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    manager.handle(StepPlan(step_id=0, new_requests=[new_request("old", [1] * 6)], req_ids=["old"],
                            num_tokens=[6], num_blocks=[2]))
    wire, kv_codec = MessageCodec(), MessageCodec.for_actor(KV_CACHE_MANAGER)
    plan = StepPlan(step_id=3, reset=True, new_requests=[new_request("a", [2] * 5)], req_ids=["a"],
                    num_tokens=[5], num_blocks=[2])
    decoded = kv_codec.decode(wire.encode(plan))
    assert isinstance(decoded, PassThroughPlan) and decoded.reset
    (forwarded,) = manager.handle(decoded).to(WORKER)
    again = wire.decode(wire.encode(forwarded))
    assert isinstance(again, StepPlan) and again.reset and again.new_requests[0].params.max_tokens == 4
    assert set(manager.block_tables) == {"a"} and manager.pool.num_free == 6


def test_worker_reset_drops_every_request_and_table_row() -> None:
    runner = FakeRunner(num_blocks=16, block_size=4, max_blocks_per_seq=4)  # the worker keeps a table array
    worker = Worker(runner, Sampler(runner.device, 0), clock=time.perf_counter)
    worker.handle(StepPlan(step_id=0, new_requests=[new_request("a", [1] * 6), new_request("b", [2] * 3)],
                           req_ids=["a", "b"], num_tokens=[6, 3], num_blocks=[2, 1], new_block_ids=[[0, 1], [2]]))
    assert set(worker.requests) == {"a", "b"}
    # A reset plan may schedule an id the worker holds as new, on other blocks: validated as fresh.
    out = worker.handle(StepPlan(step_id=4, reset=True, new_requests=[new_request("b", [2] * 3)], req_ids=["b"],
                                 num_tokens=[3], num_blocks=[1], new_block_ids=[[5]]))
    (result,) = out.to(SCHEDULER)
    assert result.reset and result.step_id == 4 and result.req_ids == ["b"]
    assert set(worker.requests) == {"b"} and worker.requests["b"].block_table == [5]
    assert worker.tables is not None and int(worker.tables.lengths[worker.requests["b"].row]) == 1
    # A plan of before the reset (say, queued behind it from the dead KV manager) is dropped.
    assert not worker.handle(StepPlan(step_id=3, req_ids=["a"], num_tokens=[1], num_blocks=[2],
                                      new_block_ids=[[]]))
    empty = worker.handle(StepPlan(step_id=9, reset=True)).to(SCHEDULER)
    assert empty == [StepResult(step_id=9, reset=True, req_ids=[], token_ids=[])] and not worker.requests


# ------------------------------------------------------------------ the tiny real model
@pytest.mark.parametrize("fault", ["worker-stale", "scheduler"])
def test_tiny_model_outputs_are_identical_after_a_restart(fault: str, tiny_qwen3: Any) -> None:
    """Real attention over real (stale, after a worker restart) KV tensors: a resumed request that
    read a block it did not recompute would drift."""
    from vllm_actors.protocol.config import EngineConfig

    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", block_size=16, num_gpu_blocks_override=12,
                          max_num_batched_tokens=32, seed=0, device="cpu")
    rng = random.Random(5)
    shared = [rng.randrange(500) for _ in range(40)]
    jobs = [
        Job(f"r{i}", (shared if i % 2 else []) + [rng.randrange(500) for _ in range(rng.randint(5, 50))],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if i % 3 else
            SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, n=2))
        for i in range(6)
    ]
    engine = InProcessEngine(config)
    plans = record_plans(engine)
    expected, steps = run(engine, jobs)
    assert engine.scheduler.stats.num_preemptions > 0
    assert any(new.num_cached_tokens for plan in plans for new in plan.new_requests)
    engine = InProcessEngine(config)
    got, _ = run(engine, jobs, {steps // 3: FAULTS[fault](), 2 * steps // 3: FAULTS[fault]()})
    assert got == expected
