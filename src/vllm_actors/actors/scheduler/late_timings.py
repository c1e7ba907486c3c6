"""The cost model taught by steps timed late: a step that samples nothing on a GPU comes back with
``execute_seconds`` 0 (its read-back does not wait for the device) and its GPU time arrives in a
later result's ``gpu_timings`` (``actors/worker/gpu_timing.py``; under pipeline parallelism every
step does: the last stage's read-back waits for the stages before it). Such a step keeps its
cost-model features here, by step id, until its time arrives; the oldest beyond
``max_steps`` are forgotten (a time that never came). A pipeline reset forgets them all. The step
read back after such a step teaches nothing itself: its wall share (``step_wall_seconds``) holds the
GPU time the timed step's read-back did not wait for.

Read-backs can come in pairs: a step launched before the previous one is read back may be done by
then (the host, not the GPU, was the slower), so its wall share is next to nothing and the previous
step's holds both GPU times (on an H200, eager mixed steps of a 1M-token prompt: 132.8 ms then 0.2 ms).
Each step's observation waits here for the next result; a result whose wall share is under
``BUNCHED_FRACTION`` of its launch-to-read-back time is taught together with the one before it, as
their average (features and seconds: a linear model's average row keeps its constant term)."""

from __future__ import annotations

from collections import OrderedDict

from vllm_actors.actors.scheduler.cost_model import CostModel, StepFeatures
from vllm_actors.actors.scheduler.deadlines import step_features, step_wall_seconds
from vllm_actors.protocol.messages import StepPlan, StepResult

MAX_WAITING_STEPS = 256  # steps awaiting their GPU time; the oldest beyond are forgotten
BUNCHED_FRACTION = 0.1  # a wall share below this part of launch-to-read-back: read back with the step before

Observation = tuple[StepFeatures, float]  # a step's features, its seconds


def read_back_with_previous(result: StepResult) -> bool:
    """The step was read back right behind the one before it (its wall share under ``BUNCHED_FRACTION`` of
    its launch-to-read-back time): the step before holds both GPU times."""
    return result.interval_seconds > 0 and step_wall_seconds(result) < BUNCHED_FRACTION * result.execute_seconds


class LateTimings:
    def __init__(self, max_steps: int = MAX_WAITING_STEPS) -> None:
        self.max_steps = max_steps
        self._waiting: OrderedDict[int, StepFeatures] = OrderedDict()  # step id -> features
        self.num_observed = 0  # steps the cost model learnt from their late GPU time
        self._after_timed = False  # the last result was a step timed on the GPU (its time is in the next's)
        self._held: Observation | None = None  # the last step's observation, taught once the next is seen

    def __len__(self) -> int:
        return len(self._waiting)

    def observe(self, cost: CostModel, plan: StepPlan, result: StepResult, block_size: int,
                features: StepFeatures | None = None) -> None:
        """Teach ``cost`` the step (``observe_step``; not right after a step timed on the GPU) or, not
        measured yet, keep it for its GPU time; then teach it the earlier steps whose GPU times the
        result carries (its own included)."""
        if not self._after_timed:
            self._teach(cost, plan, result, block_size, features)
        self._after_timed = result.execute_seconds <= 0 and bool(plan.req_ids) and not plan.draft_token_ids
        if self._after_timed:
            self._waiting[plan.step_id] = features or step_features(plan, block_size)
            while len(self._waiting) > self.max_steps:
                self._waiting.popitem(last=False)
        for timing in result.gpu_timings:
            waiting = self._waiting.pop(timing.step_id, None)
            if waiting is not None and timing.seconds > 0:
                teach(cost, waiting, timing.seconds)
                self.num_observed += 1

    def _teach(self, cost: CostModel, plan: StepPlan, result: StepResult, block_size: int,
               features: StepFeatures | None) -> None:
        """The held step's observation, alone or averaged with this one where they were read back
        together; this one held in turn. Steps not measured (``execute_seconds`` 0) or verifying drafts
        (the speculator's ``DraftCost`` learns those) teach nothing."""
        if result.execute_seconds <= 0 or plan.draft_token_ids:
            self._release(cost)  # nothing to pair the held one with
            return
        own = features or step_features(plan, block_size)
        seconds = step_wall_seconds(result)
        held, self._held = self._held, (own, seconds)
        if held is not None and read_back_with_previous(result):
            self._held = None
            tokens, decodes, pairs, scan = ((a + b) / 2 for a, b in zip(held[0], own))
            cost.observe(tokens, decodes, (held[1] + seconds) / 2, pairs, scan)
        elif held is not None:
            teach(cost, *held)

    def _release(self, cost: CostModel) -> None:
        """Teach the held observation alone."""
        held, self._held = self._held, None
        if held is not None:
            teach(cost, *held)

    def clear(self) -> None:
        """A pipeline reset: the steps in flight are gone, their times will not come."""
        self._waiting.clear()
        self._after_timed = False
        self._held = None


def teach(cost: CostModel, features: StepFeatures, seconds: float) -> None:
    cost.observe(features.prefill_tokens, features.decodes, seconds, features.pairs, features.scan)
