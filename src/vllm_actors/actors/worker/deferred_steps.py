"""A deferred step as the shell sees it: whether a launched step (or a step timed on the GPU) is
outstanding, whether it can be reported without waiting, its read-back (``flush``), and which plans
may be launched before the previous step is read back (``Worker`` mixes this in)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.protocol.outputs import Outputs

if TYPE_CHECKING:
    from vllm_actors.actors.worker.engine import TokenSampler
    from vllm_actors.actors.worker.step_data import PendingStep, WorkerRequest
    from vllm_actors.actors.worker.timing_reports import TimingReports
    from vllm_actors.protocol.messages import StepPlan, StepResult


class DeferredSteps:
    """``has_pending`` / ``pending_ready`` / ``flush`` of ``Worker``, and its ``_deferrable`` check."""

    if TYPE_CHECKING:  # provided by Worker
        requests: dict[str, WorkerRequest]
        sampler: TokenSampler
        timings: TimingReports
        _pending: PendingStep | None

        def _outputs(self, pending: PendingStep, result: StepResult) -> Outputs: ...  # the step's events, result
        def _read_back(self, pending: PendingStep) -> StepResult: ...  # its tokens appended, its result

    def has_pending(self) -> bool:
        """A launched step not read back, or a step timed on the GPU not complete when last looked."""
        return self._pending is not None or self.timings.outstanding()

    def pending_ready(self) -> bool:
        """Whether ``flush`` has something to report without waiting: the pending step's tokens
        are on the host, or (none pending) a timed step has completed."""
        if self._pending is not None:
            return self._pending.ready()
        return self.timings.ready()

    def flush(self) -> Outputs:
        """Read the launched step back: its result and events; with none pending, the timed
        steps complete since (``STEP_TIMED``; nothing when there are none)."""
        pending, self._pending = self._pending, None
        if pending is None:
            outputs = Outputs()
            self.timings.report(outputs)  # nothing on a rank other than 0 (its timer is disabled)
            return outputs
        return self._outputs(pending, self._read_back(pending))

    def _deferrable(self, plan: StepPlan) -> bool:
        """Whether every row's draw is all the step needs (no logprobs to read back)."""
        if plan.reset or plan.draft_token_ids:  # verified drafts decide the next step's inputs
            return False
        if any(self.sampler.needs_host(new.params) for new in plan.new_requests):
            return False
        return not any(
            self.sampler.needs_host(self.requests[request_id].params)
            for request_id in plan.req_ids
            if request_id in self.requests and request_id not in plan.finished_ids
        )
