"""Request ids and what the scheduler's socket may bring, in the state machines: the id rules in one
place (``protocol/names.py``), applied by the frontend and again by the scheduler; every AddRequest
checked before it touches the scheduler's state (token ids against the vocabulary, lengths, sampling
values). Raw-socket peers against a real group: process_group/test_request_identity.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.outputs import pairs
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.cumulative import CumulativeOutputs
from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import Aborted, Queued
from vllm_actors.protocol.messages import AbortRequests, AddRequest, RequestUpdate, RequestUpdates, StepPlan
from vllm_actors.protocol.names import (
    CLIENT,
    FRONTEND,
    MAX_REQUEST_ID_LENGTH,
    engine_request_id_error,
    request_id_error,
)
from vllm_actors.protocol.outputs import Outputs

VOCAB = 97


# --------------------------------------------------------------------------- the id rules
@pytest.mark.parametrize("request_id", ["r", "cmpl-3f2a", "chatcmpl-0a1B.2_c~d:e", "a" * MAX_REQUEST_ID_LENGTH])
def test_good_request_ids(request_id: str) -> None:
    assert request_id_error(request_id) is None
    assert engine_request_id_error(request_id) is None
    assert engine_request_id_error(f"{request_id}#0") is None and engine_request_id_error(f"{request_id}#17") is None


@pytest.mark.parametrize(
    ("request_id", "why"),
    [
        ("", "must not be empty"),
        ("y#1", "may hold only"),  # '#' separates an n>1 request's children
        ("a b", "may hold only"),
        ("a\nb", "may hold only"),
        ("é", "may hold only"),
        ("a" * (MAX_REQUEST_ID_LENGTH + 1), "at most 128 characters"),
        ("x" * 60_000, "got 60000"),
    ],
)
def test_bad_request_ids(request_id: str, why: str) -> None:
    error = request_id_error(request_id)
    assert error is not None and why in error
    assert len(error) < 300  # a 60 KB id is never copied into the error
    assert engine_request_id_error(request_id if "#" not in request_id else "y#a") is not None


def test_engine_ids_take_one_numeric_child_index() -> None:
    for bad in ("y#", "y#a", "y#1#2", "#1", "y#1234567890", "a b#1"):
        assert engine_request_id_error(bad) is not None, bad


# --------------------------------------------------------------------------- the frontend
def frontend() -> Frontend:
    return Frontend(None, [0], max_model_len=64, vocab_size=VOCAB)


def only_output(cumulative: CumulativeOutputs, out: Outputs) -> RequestOutput:
    """The one thing the frontend produced, a delta for its client, assembled as the client does."""
    assert len(out.messages) == 1 and not out.events, out
    (output,) = cumulative.add_all(out.to(CLIENT))
    return output


def test_the_frontend_refuses_bad_ids_before_anything_is_queued() -> None:
    front = frontend()
    for bad in ("y#1", "x" * 10_000, "", "a b"):
        with pytest.raises(ValueError, match="^request_id"):
            front.prepare(bad, {"prompt_token_ids": [1, 2]}, SamplingParams())
    assert front.num_unfinished == 0


def test_the_frontend_takes_each_token_once_by_its_position() -> None:
    """Updates that carry their output position (``output_index``): a catch-up overlapping the
    tokens a request has already gives only the new ones."""
    front, cumulative = frontend(), CumulativeOutputs()
    front.submit(front.prepare("p", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=8)))
    for tokens, index in (([5, 6], 0), ([6, 7], 1), ([5, 6, 7, 8], 0), ([9], -1)):
        cumulative.add_all(front.handle(RequestUpdates(step_id=0, updates=[
            RequestUpdate(request_id="p", new_token_ids=tokens, output_index=index)])).to(CLIENT))
    output = only_output(cumulative, front.handle(RequestUpdates(step_id=0, updates=[
        RequestUpdate(request_id="p", new_token_ids=[10], output_index=5, finish_reason="length")])))
    assert output.outputs[0].token_ids == [5, 6, 7, 8, 9, 10]


def test_a_child_id_is_never_taken_by_another_request() -> None:
    """The finding: ``y#1`` while ``y`` with n=2 runs took over y's second child, which then hung."""
    front = frontend()
    sent = front.submit(front.prepare("y", {"prompt_token_ids": [1, 2]}, SamplingParams(n=2, max_tokens=4)))
    assert [m.request_id for _, m in sent.messages if isinstance(m, AddRequest)] == ["y#0", "y#1"]
    with pytest.raises(ValueError, match="^request_id"):
        front.prepare("y#1", {"prompt_token_ids": [3]}, SamplingParams())
    # y's second child still gets its tokens and finishes
    out = front.handle(RequestUpdates(step_id=0, updates=[
        RequestUpdate(request_id="y#0", new_token_ids=[5], finish_reason="length"),
        RequestUpdate(request_id="y#1", new_token_ids=[6], finish_reason="length"),
    ]))
    output = only_output(CumulativeOutputs(), out)
    assert output.finished and [c.token_ids for c in output.outputs] == [[5], [6]]
    assert front.num_unfinished == 0


# --------------------------------------------------------------------------- the scheduler
def scheduler(vocab_size: int | None = VOCAB) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                                     enable_chunked_prefill=True, block_size=4, num_blocks=100,
                                     vocab_size=vocab_size))


def add(request_id: str, prompt: list[int], eos: list[int] | None = None, **params: Any) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=prompt, eos_token_ids=[0] if eos is None else eos,
                      params=SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}))


def with_seed(message: AddRequest, seed: int) -> AddRequest:
    """A seed set after construction (as in process; over the wire decoding refuses it already)."""
    message.params.seed = seed
    return message


def only_error(out: Outputs) -> str:
    updates = [u for d, m in pairs(out) if d == FRONTEND and isinstance(m, RequestUpdates) for u in m.updates]
    assert len(updates) == 1 and updates[0].finish_reason == "error", out
    assert not [m for _, m in pairs(out) if isinstance(m, Queued) or (isinstance(m, StepPlan) and m.req_ids)], out
    return updates[0].error or ""


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (add("a", [1, VOCAB]), f"prompt token ids must lie in [0, {VOCAB - 1}]"),
        (add("a", [1, 100_000]), "prompt token ids must lie in"),
        (add("a", [1, -1]), "prompt token ids must lie in"),
        (add("a", [1], eos=[-(10**12)]), "eos_token_ids must lie in"),  # the sampler indexes with these
        (add("a", [1], eos=[VOCAB]), "eos_token_ids must lie in"),
        (add("a", [1] * 65), "more than max_model_len (64)"),
        (add("a", []), "the prompt is empty"),
        (with_seed(add("a", [1]), 2**63), "seed must be <= 9223372036854775807"),
        (add("a#x", [1]), "a child's index"),
        (add("x" * 1000, [1]), "at most 128 characters"),
    ],
)
def test_the_scheduler_refuses_what_its_socket_may_bring(message: AddRequest, error: str) -> None:
    s = scheduler()
    out = s.handle(message)
    assert error in only_error(out)
    assert not s.requests and not s.waiting and not s.running


def test_sampling_values_are_checked_again() -> None:
    """A field set after construction skipped SamplingParams' checks: the scheduler runs them."""
    bad = add("a", [1, 2])
    bad.params.top_p = 7.0
    assert "top_p" in only_error(scheduler().handle(bad))


def test_without_a_known_vocabulary_ids_are_checked_against_int32() -> None:
    s = scheduler(vocab_size=None)
    assert "must lie in [0, 2147483647]" in only_error(s.handle(add("a", [2**31])))
    assert s.handle(add("b", [100_000]))  # planned


def test_a_refused_duplicate_leaves_no_event_in_the_holders_timeline() -> None:
    s = scheduler()
    s.handle(add("a", [1, 2, 3]))
    out = s.handle(add("a", [4, 5]))
    (update,) = [u for d, m in pairs(out) if d == FRONTEND and isinstance(m, RequestUpdates) for u in m.updates]
    assert update.finish_reason == "error" and "already in use" in (update.error or "")
    assert not [e for _, e in pairs(out) if isinstance(e, (Aborted, Queued))]
    assert s.requests["a"].prompt_token_ids.tolist() == [1, 2, 3]
    # a refusal of a fresh, well-formed id does say why in its own timeline
    out = s.handle(add("b", [1, VOCAB]))
    assert [e.request_id for _, e in pairs(out) if isinstance(e, Aborted)] == ["b"]


def test_a_long_abort_reason_is_cut_before_it_reaches_the_bus() -> None:
    s = scheduler()
    s.handle(add("a", [1, 2, 3]))
    out = s.handle(AbortRequests(request_ids=["a"], reason="x" * 100_000))
    (aborted,) = [e for _, e in pairs(out) if isinstance(e, Aborted)]
    assert len(aborted.reason) <= 64 and not s.requests


