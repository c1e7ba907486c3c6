"""Each client connection owns its request ids (``actors/scheduler/owners.py``): adds, aborts and
resubmissions screened by their sender, updates split by owner with the stamps they carry, and how
the shells stamp a message's departure."""

from __future__ import annotations

import time

import msgspec

from tests.state_machines.test_request_ids import add
from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.protocol.messages import AbortRequests, RequestUpdate, RequestUpdates

# --------------------------------------------------------------------------- ownership, pure
A, B = b"client-a", b"client-b"


def test_ownership_add_abort_and_updates() -> None:
    owners = RequestOwners()
    message, refusal = owners.screen(A, add("r", [1]))
    assert refusal is None and message is not None
    owners.observe(A, message)
    assert owners.owner("r") == A
    # another connection: refused, answered to it alone, the owner unchanged
    for newcomer in (add("r", [2]), msgspec.structs.replace(add("r", [2]), resume=True, output_token_ids=[3])):
        message, refusal = owners.screen(B, newcomer)
        assert message is None and refusal is not None and "another client's request" in refusal.error
        assert refusal.reply is not None and refusal.reply.updates[0].finish_reason == "error"
    # the owner itself: a resubmission passes, a plain duplicate does not
    assert owners.screen(A, msgspec.structs.replace(add("r", [1]), resume=True))[1] is None
    assert owners.screen(A, add("r", [1]))[1] is not None
    # aborts: only the sender's own ids go on; unknown ids quietly left out
    owners.observe(B, owners.screen(B, add("s", [1]))[0])
    message, refusal = owners.screen(B, AbortRequests(request_ids=["r", "s", "gone"], reason="abort"))
    assert message == AbortRequests(request_ids=["s"], reason="abort")
    assert refusal is not None and "'r'" in refusal.error and refusal.reply is None
    message, refusal = owners.screen(B, AbortRequests(request_ids=["r"]))
    assert message is None and refusal is not None
    assert owners.screen(A, AbortRequests(request_ids=["r", "gone"])) == (AbortRequests(request_ids=["r"]), None)
    # updates go to their owner; a finished request is forgotten
    split = owners.split(RequestUpdates(step_id=1, updates=[RequestUpdate(request_id="r", new_token_ids=[1]),
                                                            RequestUpdate(request_id="s", finish_reason="stop")],
                                        step_finished_at=5.0, sent_at=6.0))
    assert {owner: [u.request_id for u in m.updates] for owner, m in split.items()} == {A: ["r"], B: ["s"]}
    assert all((m.step_finished_at, m.sent_at) == (5.0, 6.0) for m in split.values())  # the stamps go along
    assert owners.owner("s") is None and owners.owner("r") == A


def test_ownership_is_taken_again_by_the_resubmission_after_a_restart() -> None:
    """A restarted scheduler's shell starts empty: each client's resubmission makes it the owner."""
    owners = RequestOwners()
    resume = msgspec.structs.replace(add("r", [1]), resume=True, output_token_ids=[4])
    message, refusal = owners.screen(A, resume)
    assert refusal is None
    owners.observe(A, message)
    assert owners.screen(B, resume)[1] is not None
    assert owners.screen(B, AbortRequests(request_ids=["r"]))[0] is None


def test_an_abort_of_all_of_the_senders_requests_takes_its_own_only() -> None:
    """A client restarted under a dead one's routing id drops what that one left (an API process
    of --api-server-count): every id the connection owns, none of another's."""
    owners = RequestOwners()
    for sender, request_id in ((A, "a1"), (A, "a2"), (B, "b1")):
        owners.observe(sender, owners.screen(sender, add(request_id, [1]))[0])
    message, refusal = owners.screen(A, AbortRequests(request_ids=[], reason="client restarted", all_of_sender=True))
    assert refusal is None
    assert message == AbortRequests(request_ids=["a1", "a2"], reason="client restarted")
    owners.observe(A, message)
    assert owners.owner("a1") is None and owners.owner("b1") == B
    assert owners.screen(A, AbortRequests(request_ids=[], all_of_sender=True)) == (None, None)  # nothing left


# --------------------------------------------------------------------------- the shells' stamps
def test_the_shells_stamp_departures_once() -> None:
    """A worker's result and a scheduler's updates get the sending shell's monotonic time; a
    controller forwarding a replica's updates keeps the replica's stamp."""
    from vllm_actors.protocol.messages import StepResult
    from vllm_actors.runtime.loop import stamp_departure

    result = StepResult(step_id=0, req_ids=[], token_ids=[])
    before = time.monotonic()
    stamp_departure(result)
    assert before <= result.finished_at <= time.monotonic()
    updates = RequestUpdates(step_id=0, updates=[], step_finished_at=result.finished_at)
    stamp_departure(updates)
    sent = updates.sent_at
    assert sent >= result.finished_at
    stamp_departure(updates)  # forwarded: unchanged
    assert updates.sent_at == sent
