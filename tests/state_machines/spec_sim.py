"""The scheduler's speculator (``Speculator``: its plan, probes and accounting) driven step by step
against a fake device whose step costs are set, with n-gram drafts made in the worker (two steps in
flight): how the policy prices and chooses drafts, without processes or a clock.

The device: a plain decode step of ``B`` requests costs ``plain(B)`` of wall time; a step that
verifies drafts is read back at once (the deferred pipeline drained, the draw outside the decode
graph), so it costs ``plain(B) + verify_fixed(B) + per_token * drafted``; the first plain step after
it costs ``switch(B)`` more (its inputs prepared while the device idles). Each drafted position is
accepted with ``acceptance`` (seeded), up to the first rejected one. A request's lookup finds its
drafts with chance ``found`` (else none: a plain row), ``longest`` of them at most (text of short
repeats); a step whose lookups all found nothing runs as a plain step, but the pipeline was drained
for it: it costs ``switch(B)`` more.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_actors.actors.scheduler.cost_model import OnlineCostModel
from vllm_actors.actors.scheduler.deadlines import observe_step, step_features
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status
from vllm_actors.actors.scheduler.speculation import Speculator
from vllm_actors.protocol.messages import StepPlan, StepResult
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

MS = 1e-3


def INTERVAL(seconds: float) -> dict[str, float]:  # noqa: N802  # (a StepResult without the field: the old one)
    return {"interval_seconds": seconds} if "interval_seconds" in StepResult.__struct_fields__ else {}


@dataclass
class Device:
    """Step costs in seconds (module docstring)."""

    plain: Callable[[int], float] = lambda b: 0.70 * MS + 0.013 * MS * b
    verify_fixed: Callable[[int], float] = lambda b: 0.55 * MS
    per_token: float = 0.004 * MS
    switch: Callable[[int], float] = lambda b: 0.25 * MS + 0.004 * MS * b
    acceptance: float = 0.8
    found: float = 1.0
    longest: int = 1 << 20  # the most drafts a lookup finds
    first_verify: float = 0.0  # added once to the first drafting step (a first use that compiles)
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    verified: int = 0

    def step(self, batch: int, drafts: dict[str, int], after_drafting: bool) -> float:
        seconds = self.plain(batch)
        if drafts:
            seconds += self.verify_fixed(batch) + self.per_token * sum(drafts.values())
            seconds += self.first_verify if not self.verified else 0.0
            self.verified += 1
        elif after_drafting:
            seconds += self.switch(batch)
        return seconds

    def accepted(self, num_drafts: int) -> int:
        count = 0
        while count < num_drafts and self.rng.random() < self.acceptance:
            count += 1
        return count


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafting_steps: int = 0
    drafted: int = 0
    planned_steps: int = 0  # steps whose plan had drafts (found or not)
    requests: list[float] = field(default_factory=list)  # each wave's seconds per token

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def new_speculator(adaptive: bool = True) -> tuple[Speculator, OnlineCostModel]:
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2}, adaptive=adaptive)
    cost = OnlineCostModel()
    return Speculator(config, cost, block_size=16, overlapped=True), cost


def simulate(device: Device, batch: int, output_len: int, waves: int = 1, speculate: bool = True,
             speculator: tuple[Speculator, OnlineCostModel] | None = None) -> Run:
    """``waves`` rounds of ``batch`` requests of ``output_len`` tokens each, one step in flight at a
    time (each plan's result accounted before the next plan: the speculator's state is the same)."""
    spec, cost = speculator or new_speculator()
    run, step_id, after_drafting = Run(), 0, False
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for wave in range(waves):
        requests = {f"{wave}-{i}": ScheduledRequest(f"{wave}-{i}", list(range(100)), params, [], output_token_ids=[1],
                                                    num_computed_tokens=100, status=Status.RUNNING, in_worker=True)
                    for i in range(batch)}
        started_tokens, started_seconds = run.tokens, run.seconds
        while requests:
            running = list(requests.values())
            if speculate:
                spec.begin_pass(running)
            drafts: dict[str, list[int]] = {}
            for request in running:
                found = spec.drafts(request, 1 << 20, 1 << 20) if speculate else []
                if found:
                    drafts[request.request_id] = found
                    request.num_pending_drafts += len(found)
                request.num_computed_tokens += 1 + len(found or [])
            plan = StepPlan(step_id=step_id, req_ids=[r.request_id for r in running],
                            num_tokens=[1 + len(drafts.get(r.request_id, [])) for r in running],
                            num_blocks=[1 + r.num_computed_tokens // 16 for r in running], draft_token_ids=drafts)
            found = {k: min(len(v), device.longest) for k, v in drafts.items()
                     if device.found >= 1.0 or device.rng.random() < device.found}
            seconds = device.step(len(running), found, after_drafting)
            if drafts and not found:  # placeholders that found nothing: drained for a plain step
                seconds += device.switch(len(running))
            after_drafting = bool(found)
            req_ids = []
            for request in running:
                gained = 1 + device.accepted(found.get(request.request_id, 0))
                gained = min(gained, output_len - len(request.output_token_ids))
                req_ids += [request.request_id] * gained
            result = StepResult(step_id=step_id, req_ids=req_ids, token_ids=[7] * len(req_ids),
                                num_drafted={k: found.get(k, 0) for k in drafts if found.get(k, 0) < len(drafts[k])},
                                execute_seconds=seconds, **INTERVAL(seconds))
            features = step_features(plan, 16)  # once for both, as the scheduler does
            observe_step(cost, plan, result, 16, features)
            if speculate:
                spec.account(plan, result, requests, features)
            for request_id in req_ids:
                requests[request_id].output_token_ids.append(7)
            for request in running:
                if len(request.output_token_ids) >= output_len:
                    spec.forget(request)
                    del requests[request.request_id]
            run.tokens += len(req_ids)
            run.seconds += seconds
            run.steps += 1
            run.drafting_steps += bool(found)
            run.planned_steps += bool(drafts)
            run.drafted += sum(found.values())
            step_id += 1
        run.requests.append((run.seconds - started_seconds) / (run.tokens - started_tokens))
    return run
