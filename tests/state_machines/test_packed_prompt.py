"""AddRequest's packed prompt (``packed_prompt``, what the frontend sends): the scheduler plans and
reports exactly as for the same prompt as a list, refuses a malformed one saying why (leaving every
other request as it was), and the frontend and the controller read it as they read the list."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.state_machines.test_routing import BLOCK, cached
from tests.support.outputs import pairs
from tests.support.scheduler_messages import add, scheduler
from vllm_actors.actors.controller.controller import Controller
from vllm_actors.actors.controller.routing import Router
from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import Aborted, Arrived, EventBatch
from vllm_actors.protocol.messages import AddRequest, RequestUpdates, StepPlan, StepResult
from vllm_actors.protocol.names import FRONTEND, SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids

VOCAB = 1000
CODEC = MessageCodec()


def packed(message: AddRequest) -> AddRequest:
    """The same request with its prompt packed, as the frontend sends it, through the wire."""
    form = msgspec.structs.replace(message, prompt_token_ids=[], packed_prompt=pack_token_ids(message.prompt_token_ids))
    return CODEC.decode(CODEC.encode(form))  # type: ignore[return-value]


def run(s: Scheduler, arrivals: list[AddRequest]) -> list[Any]:
    """Every message and event of the arrivals and of the steps they make, a worker sampling token 9
    for each request that completes its known tokens, until no plan is left."""
    answered: set[int] = set()
    seen: list[Any] = []
    for message in arrivals:
        seen += pairs(s.handle(message))
    while plans := [m for _, m in seen if isinstance(m, StepPlan) and m.step_id not in answered]:
        (plan,) = plans  # one step in flight
        answered.add(plan.step_id)
        sampled = [r for r in plan.req_ids if r in s.requests and s.requests[r].num_pending]
        seen += pairs(s.handle(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=sampled,
                                          token_ids=[9] * len(sampled))))
    return seen


def test_a_packed_prompt_gives_the_plans_events_and_updates_of_the_same_prompt_as_a_list() -> None:
    shared = [7 + i % 50 for i in range(22)]
    arrivals = [
        add("a", shared + [3, 4, 5]),
        add("b", shared + [8] * 9, max_tokens=3),  # shares a's first blocks: a prefix-cache hit
        add("c", [5, 6, 7, 8, 9, 10], outputs=[11, 12]),  # a resubmission: prompt packed, outputs listed
    ]
    config: dict[str, Any] = dict(max_num_batched_tokens=16, max_steps_in_flight=1, enable_prefix_caching=True,
                                  vocab_size=VOCAB)
    listed = run(scheduler(**config), arrivals)
    assert run(scheduler(**config), [packed(message) for message in arrivals]) == listed
    plans = [m for _, m in listed if isinstance(m, StepPlan)]
    assert any(plan.cached_hashes for plan in plans)
    assert any(new.num_cached_tokens for plan in plans for new in plan.new_requests)  # b's hit
    finished = [u.request_id for _, m in listed if isinstance(m, RequestUpdates) for u in m.updates if u.finish_reason]
    assert sorted(finished) == ["a", "b", "c"]


@pytest.mark.parametrize(("fields", "why"), [
    ({"prompt_token_ids": [1, 2], "packed_prompt": pack_token_ids([1, 2])}, "not both"),
    ({"packed_prompt": b"\x01\x00\x00\x00\x02"}, "4 bytes per token id, got 5 bytes"),
    ({"packed_prompt": pack_token_ids([1, VOCAB])}, f"prompt token ids must lie in [0, {VOCAB - 1}]"),
    ({"packed_prompt": pack_token_ids([4, -1])}, f"prompt token ids must lie in [0, {VOCAB - 1}]"),
    ({"packed_prompt": b""}, "the prompt is empty"),
    ({"packed_prompt": pack_token_ids([1] * 65)}, "more than max_model_len (64)"),
])
def test_a_malformed_packed_prompt_is_refused_saying_why_and_nothing_else_changes(
        fields: dict[str, Any], why: str) -> None:
    s = scheduler(vocab_size=VOCAB, max_steps_in_flight=1)
    s.handle(add("a", [1, 2, 3, 4, 5]))
    before = (list(s.requests), [r.request_id for r in s.running], s.ledger.num_free)
    bad = AddRequest(request_id="bad", params=SamplingParams(max_tokens=2), eos_token_ids=[0], **fields)
    out = s.handle(CODEC.decode(CODEC.encode(bad)))  # type: ignore[arg-type]
    (update,) = [u for d, m in pairs(out) if d == FRONTEND and isinstance(m, RequestUpdates) for u in m.updates]
    assert update.request_id == "bad" and update.finish_reason == "error" and why in (update.error or "")
    assert [e.request_id for e in out.events if isinstance(e, Aborted)] == ["bad"]
    assert not [m for _, m in pairs(out) if isinstance(m, StepPlan)]
    assert (list(s.requests), [r.request_id for r in s.running], s.ledger.num_free) == before


def test_the_frontend_sends_the_prompt_packed_and_checks_it_as_before() -> None:
    frontend = Frontend(None, [0], max_model_len=64, vocab_size=VOCAB)
    out = frontend.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, n=2))
    adds = [m for to, m in out.messages if to == SCHEDULER and isinstance(m, AddRequest)]
    assert len(adds) == 2 and all(a.prompt_token_ids == [] and a.prompt_form_error() is None for a in adds)
    assert all(list(a.prompt_ids()) == [5, 6, 7] and a.num_prompt_tokens == 3 for a in adds)
    assert [e.num_prompt_tokens for e in out.events if isinstance(e, Arrived)] == [3, 3]
    assert [list(a.prompt_ids()) for _, a in frontend.resubmit().messages] == [[5, 6, 7]] * 2  # resubmitted packed
    for bad in (VOCAB, -1, 2**31, -(2**31) - 1):  # the last two fit no int32: the list names them all the same
        with pytest.raises(ValueError, match=rf"^prompt_token_ids: token id {bad} is out of vocabulary"):
            frontend.prepare(f"x{bad}", {"prompt_token_ids": [1, bad, 2]}, SamplingParams(max_tokens=1))


def test_the_controller_routes_a_packed_prompt_as_its_list_and_passes_a_malformed_one_on() -> None:
    tenant = list(range(100, 116))
    controllers = [Controller(Router("cache_aware", 2, block_size=BLOCK)) for _ in range(2)]
    for controller in controllers:
        controller.observe("kv_cache_manager@1", EventBatch(actor="kv_cache_manager@1", first_seq=0, mono=0, wall=0,
                                                            events=[cached(tenant, 4)]))
    message = add("a", tenant + [1])
    routed = [controller.handle(form) for controller, form in zip(controllers, (message, packed(message)), strict=True)]
    assert [out.messages[0][0] for out in routed] == ["scheduler@1", "scheduler@1"]
    assert routed[0].events == routed[1].events
    odd = msgspec.structs.replace(message, request_id="odd", prompt_token_ids=[], packed_prompt=b"\x01\x02")
    (to, sent), = controllers[0].handle(odd).messages  # the replica's scheduler refuses it, saying why
    assert to.startswith("scheduler@") and sent is odd
