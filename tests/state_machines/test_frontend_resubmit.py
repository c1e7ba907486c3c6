"""Recovery on the client side, the frontend state machine alone: after a scheduler
restart ``Frontend.resubmit`` sends every unfinished request again (resume=True, with the tokens
received so far, its priority, deadlines, children and seeds); when the group fails ``fail_all``
ends every open request at once with finish reason "error". The clients and the HTTP server
across a restart are in clients/ (test_client_recovery.py, test_async_client_recovery.py, test_http_recovery.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.fake_scheduler import (
    MAX_MODEL_LEN,
)
from tests.support.tiny_models import build_tokenizer
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.cumulative import CumulativeOutputs
from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.frontend.outputs import OutputDelta, RequestOutput
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    Logprobs,
    Message,
    RequestUpdate,
    RequestUpdates,
)
from vllm_actors.protocol.names import CLIENT, SCHEDULER
from vllm_actors.protocol.outputs import Outputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return load_tokenizer(path)



class AssembledFrontend(Frontend):
    """The frontend with its client deltas assembled into cumulative outputs, as a client does."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer, [tokenizer.eos_token_id or 0], MAX_MODEL_LEN, tokenizer.vocab_size)
        self.cumulative = CumulativeOutputs()

    def handle(self, message: Message) -> Outputs:
        return self._assembled(super().handle(message))

    def fail_all(self, error: str) -> Outputs:
        return self._assembled(super().fail_all(error))

    def _assembled(self, out: Outputs) -> Outputs:
        return Outputs([(destination, self.cumulative.add(message) if isinstance(message, OutputDelta) else message)
                        for destination, message in out.messages], out.events)


def make_frontend(tokenizer: Tokenizer) -> Frontend:
    return AssembledFrontend(tokenizer)


def updates(*items: RequestUpdate) -> RequestUpdates:
    return RequestUpdates(step_id=0, updates=list(items))


def outputs_of(out: Outputs) -> list[RequestOutput]:
    return out.to(CLIENT)


def adds_of(out: Outputs) -> list[AddRequest]:
    return [message for message in out.to(SCHEDULER) if isinstance(message, AddRequest)]


# =========================================================================== the frontend
def test_resubmit_sends_each_unfinished_request_with_the_tokens_received(tokenizer: Tokenizer) -> None:
    frontend = make_frontend(tokenizer)
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    words = tokenizer.encode(" jumps over the lazy dog. Hello world!", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=len(words), seed=3)
    (original,) = adds_of(frontend.add_request("r", {"prompt_token_ids": prompt}, params))
    assert frontend.resubmit().messages[0][1].output_token_ids == []  # nothing received yet: from the start

    frontend.handle(updates(RequestUpdate(request_id="r", new_token_ids=words[:4])))
    ((destination, again),) = frontend.resubmit().messages
    assert destination == SCHEDULER and isinstance(again, AddRequest)
    assert again.resume and not original.resume and again.output_token_ids == words[:4]
    assert (again.request_id, list(again.prompt_ids()), again.params, again.eos_token_ids) == (
        original.request_id, list(original.prompt_ids()), original.params, original.eos_token_ids)
    # The new scheduler sends only what follows; the detokenizer continues where it was.
    frontend.handle(updates(RequestUpdate(request_id="r", new_token_ids=words[4:6])))
    assert adds_of(frontend.resubmit())[0].output_token_ids == words[:6]  # a second restart
    (final,) = outputs_of(frontend.handle(updates(
        RequestUpdate(request_id="r", new_token_ids=words[6:], finish_reason="length"))))
    completion = final.outputs[0]
    assert final.finished and completion.token_ids == words and completion.finish_reason == "length"
    assert completion.text == tokenizer.decode(words)
    assert not frontend.resubmit()


def test_resubmit_keeps_priority_and_deadlines_without_an_arrival_time(tokenizer: Tokenizer) -> None:
    """A resubmission after a scheduler restart keeps its scheduling (priority, deadlines) but is never
    refused as late: it carries no arrival time."""
    frontend = make_frontend(tokenizer)
    prepared = dataclasses.replace(frontend.prepare("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4)),
                                   priority=2, ttft_target_ms=100.0, e2e_target_ms=1000.0, arrival_time=50.0)
    (original,) = adds_of(frontend.submit(prepared))
    assert (original.priority, original.ttft_deadline, original.e2e_deadline, original.arrival_time) == (
        2, 50.1, 51.0, 50.0)
    (again,) = adds_of(frontend.resubmit())
    assert (again.priority, again.ttft_deadline, again.e2e_deadline, again.arrival_time) == (2, 50.1, 51.0, None)


def test_resubmit_leaves_finished_children_out_and_keeps_each_childs_seed(tokenizer: Tokenizer) -> None:
    frontend = make_frontend(tokenizer)
    eos = tokenizer.eos_token_id
    assert eos is not None
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    originals = adds_of(frontend.add_request("p", {"prompt_token_ids": prompt}, params))
    assert [a.params.seed for a in originals] == [5, 6, 7]
    frontend.handle(updates(
        RequestUpdate(request_id="p#0", new_token_ids=[300, eos], finish_reason="stop", stop_reason=eos),
        RequestUpdate(request_id="p#1", new_token_ids=[301, 302, 303]),
    ))
    resent = adds_of(frontend.resubmit())
    assert [a.request_id for a in resent] == ["p#1", "p#2"]
    assert [a.params for a in resent] == [originals[1].params, originals[2].params]
    assert [a.output_token_ids for a in resent] == [[301, 302, 303], []]
    assert all(a.resume and list(a.prompt_ids()) == prompt for a in resent)
    # Without a seed each child resumes unseeded, as it was sent.
    unseeded = adds_of(make_frontend(tokenizer).add_request("u", {"prompt_token_ids": prompt},
                                                              params.clone(seed=None)))
    assert {a.params.seed for a in unseeded} == {None}


def test_a_child_cut_at_a_stop_string_is_finished_and_held_back_text_survives(tokenizer: Tokenizer) -> None:
    frontend = make_frontend(tokenizer)
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    text = " jumps over the lazy dog. The cat sat on the mat."
    tokens = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=len(tokens), stop=["lazy dog", "lazy cat"])
    frontend.add_request("s", {"prompt_token_ids": prompt}, params)
    # Child 0 meets "lazy dog": finished here (abort "stop" to the scheduler), whatever follows.
    out = frontend.handle(updates(RequestUpdate(request_id="s#0", new_token_ids=tokens)))
    assert any(isinstance(m, AbortRequests) and m.request_ids == ["s#0"] for _, m in out.messages)
    # Child 1 stops receiving right after "lazy": that text is held back (it may begin a stop string).
    lazy = next(i for i in range(len(tokens)) if tokenizer.decode(tokens[: i + 1]).endswith("lazy"))
    (partial,) = outputs_of(frontend.handle(updates(RequestUpdate(request_id="s#1", new_token_ids=tokens[: lazy + 1]))))
    assert partial.outputs[0].finish_reason == "stop" and partial.outputs[0].text == " jumps over the "
    assert partial.outputs[1].text == " jumps over the " and partial.outputs[1].token_ids == tokens[: lazy + 1]

    (again,) = adds_of(frontend.resubmit())  # child 0 is not sent again
    assert again.request_id == "s#1" and again.output_token_ids == tokens[: lazy + 1]
    assert again.params.stop == ["lazy dog", "lazy cat"] and again.params.seed == 2
    # The resumed child goes on with other tokens: the held-back "lazy" is released, once.
    rest = tokenizer.encode(" sheep ate grass.", add_special_tokens=False)
    (final,) = outputs_of(frontend.handle(updates(
        RequestUpdate(request_id="s#1", new_token_ids=rest, finish_reason="length"))))
    assert final.finished and final.outputs[1].text == tokenizer.decode(tokens[: lazy + 1] + rest)
    assert final.outputs[0].text == " jumps over the " and final.outputs[0].stop_reason == "lazy dog"
    # A request that stopped altogether is not sent again.
    frontend.add_request("t", {"prompt_token_ids": prompt}, params.clone(n=1))
    frontend.handle(updates(RequestUpdate(request_id="t", new_token_ids=tokens)))
    assert not frontend.resubmit()


def test_logprobs_continue_after_a_resubmission(tokenizer: Tokenizer) -> None:
    frontend = make_frontend(tokenizer)
    prompt = tokenizer.encode("Hello world", add_special_tokens=False)

    def entry(token: int) -> Logprobs:
        return Logprobs(token_ids=[token, token + 1], logprobs=[-0.5, -1.5], ranks=[1, 2])

    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, prompt_logprobs=1)
    frontend.add_request("l", {"prompt_token_ids": prompt}, params)
    prompt_entries = [entry(t) for t in prompt[1:]]
    frontend.handle(updates(RequestUpdate(request_id="l", new_token_ids=[310, 311], logprobs=[entry(310), entry(311)],
                                          prompt_logprobs=prompt_entries, prompt_logprobs_start=1)))
    (again,) = adds_of(frontend.resubmit())
    assert again.output_token_ids == [310, 311] and again.params.logprobs == 1 and again.params.prompt_logprobs == 1
    # The restarted scheduler recomputes: the prompt's logprobs may come again (same positions).
    (final,) = outputs_of(frontend.handle(updates(RequestUpdate(
        request_id="l", new_token_ids=[312, 313], logprobs=[entry(312), entry(313)],
        prompt_logprobs=prompt_entries, prompt_logprobs_start=1, finish_reason="length"))))
    completion = final.outputs[0]
    assert completion.token_ids == [310, 311, 312, 313]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    assert [next(iter(position)) for position in completion.logprobs] == [310, 311, 312, 313]
    assert completion.cumulative_logprob == pytest.approx(-2.0)
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == len(prompt)
    assert final.prompt_logprobs[0] is None and all(p is not None for p in final.prompt_logprobs[1:])


def test_fail_all_ends_every_open_request_with_the_reason(tokenizer: Tokenizer) -> None:
    frontend = make_frontend(tokenizer)
    eos = tokenizer.eos_token_id
    frontend.add_request("a", {"prompt_token_ids": [300, 301]}, SamplingParams(max_tokens=8))
    frontend.add_request("b", {"prompt_token_ids": [302]}, SamplingParams(n=2, max_tokens=8))
    frontend.handle(updates(RequestUpdate(request_id="a", new_token_ids=[305]),
                            RequestUpdate(request_id="b#0", new_token_ids=[306, eos], finish_reason="stop")))
    out = frontend.fail_all("restart budget spent")
    # nothing for a dead scheduler
    assert not out.events and all(destination == CLIENT for destination, _ in out.messages)
    by_id = {o.request_id: o for o in outputs_of(out)}
    assert set(by_id) == {"a", "b"} and all(o.finished and o.error == "restart budget spent" for o in by_id.values())
    assert by_id["a"].outputs[0].finish_reason == "error" and by_id["a"].outputs[0].token_ids == [305]
    assert [c.finish_reason for c in by_id["b"].outputs] == ["stop", "error"]
    assert frontend.num_unfinished == 0 and not frontend.resubmit()
    assert not frontend.handle(updates(RequestUpdate(request_id="a", new_token_ids=[307])))
