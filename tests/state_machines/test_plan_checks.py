"""``actors/worker/plan_checks.py``: each kind of bad step plan is refused with a reason naming it,
and a good plan passes (pure: no runner, no sockets)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_actors.actors.worker.plan_checks import check_plan
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.messages import NewRequest, StepPlan
from vllm_actors.protocol.sampling import SamplingParams, StructuredOutputs
from vllm_actors.protocol.token_ids import pack_token_ids


@dataclass
class Held:
    num_computed_tokens: int
    token_ids: list[int]
    num_pending: int = 0
    block_table: list[int] = field(default_factory=list)


def new(request_id: str, tokens: list[int], params: SamplingParams | None = None) -> NewRequest:
    return NewRequest(request_id=request_id, token_ids=pack_token_ids(tokens), num_prompt_tokens=len(tokens),
                      num_output_tokens=0, params=params or SamplingParams(), eos_token_ids=[])


HELD = {"a": Held(num_computed_tokens=4, token_ids=[1, 2, 3, 4, 5], block_table=[0, 1])}


def check(plan: StepPlan, grammars: bool = True) -> None:
    check_plan(plan, HELD, has_grammars=grammars, num_blocks=8, table_width=3)


def test_a_good_plan_passes() -> None:
    check(StepPlan(step_id=1, new_requests=[new("b", [7, 8])], req_ids=["a", "b"], num_tokens=[1, 2],
                   num_blocks=[1, 1], new_block_ids=[[2], [3]]))


@pytest.mark.parametrize("plan,why", [
    (StepPlan(step_id=1, req_ids=["a"], num_tokens=[1, 1], num_blocks=[1], new_block_ids=[[]]), "differ in length"),
    (StepPlan(step_id=1, req_ids=["z"], num_tokens=[1], num_blocks=[1], new_block_ids=[[]]), "unknown request 'z'"),
    (StepPlan(step_id=1, req_ids=["a"], num_tokens=[2], num_blocks=[1], new_block_ids=[[]]), "2 tokens for 'a', 1"),
    (StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1], new_block_ids=[[8]]), "outside the pool"),
    (StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1], new_block_ids=[[2, 3]]), "more blocks"),
    (StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1], new_block_ids=[[]], reset=True),
     "unknown request 'a'"),  # a reset plan starts from nothing
    (StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1], new_block_ids=[[]], finished_ids=["a"]),
     "unknown request 'a'"),  # finished in this very plan
])
def test_bad_plans_are_refused_naming_why(plan: StepPlan, why: str) -> None:
    with pytest.raises(MessageRejected, match=why):
        check(plan)


def test_new_requests_are_checked_too() -> None:
    broken = new("b", [7, 8])
    broken.token_ids = broken.token_ids[:-1]
    with pytest.raises(MessageRejected, match="4 bytes each"):
        check(StepPlan(step_id=1, new_requests=[broken], req_ids=[], num_tokens=[], num_blocks=[], new_block_ids=[]))
    constrained = new("c", [7], SamplingParams(structured_outputs=StructuredOutputs(regex="a+")))
    plan = StepPlan(step_id=1, new_requests=[constrained], req_ids=["c"], num_tokens=[1], num_blocks=[1],
                    new_block_ids=[[4]])
    check(plan)
    with pytest.raises(MessageRejected, match="need grammars"):
        check(plan, grammars=False)
