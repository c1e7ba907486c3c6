"""Streamed outputs cost O(n): the frontend sends its client only what each update adds (an
``OutputDelta``; the prompt, its ids and its logprobs once), and the client assembles vLLM's
cumulative ``RequestOutput`` by appending to lists it keeps, copying nothing already received.

The frontend and the client core run here on synthetic scheduler updates (no engine): a request
of 4,000 generated tokens after a 100,000-token prompt, with logprobs and prompt logprobs. The
test counts the items each update carries and checks the cumulative lists are the same objects
from update to update (grown in place, never copied); no timer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.tiny_models import build_tokenizer
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.cumulative import CumulativeOutputs
from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.frontend.outputs import OutputDelta, RequestOutput
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer
from vllm_actors.clients.core import ClientCore
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.protocol.messages import Logprobs, Message, RequestUpdate, RequestUpdates
from vllm_actors.protocol.names import CLIENT
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.server.streaming import merge_streams

PREFILL_CHUNK = 8192  # prompt positions per prefill step (chunked prefill)
PER_UPDATE_BOUND = 2  # list items a one-token update carries: its token id and its logprob position


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return load_tokenizer(path)


class RecordingFrontend(Frontend):
    """The frontend, keeping every delta it sends its client."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        super().__init__(tokenizer, [tokenizer.eos_token_id or 0], max_model_len, tokenizer.vocab_size)
        self.deltas: list[OutputDelta] = []

    def handle(self, message: Message) -> Outputs:
        out = super().handle(message)
        self.deltas.extend(out.to(CLIENT))
        return out


@dataclass
class NoTransport:
    sent: list[tuple[str, Any]] = field(default_factory=list)

    def publish(self, events: list[Any]) -> None:
        pass

    def send(self, destination: str, message: Message) -> None:
        self.sent.append((destination, message))


def clean_ids(tokenizer: Tokenizer) -> list[int]:
    """Tokens that decode alone to printable ASCII (no partial character held back)."""
    texts = {token_id: tokenizer.decode([token_id]) for token_id in range(tokenizer.vocab_size)}
    return [token_id for token_id, text in texts.items() if text and text.isascii() and text.isprintable()]


def entry(token_id: int) -> Logprobs:
    return Logprobs(token_ids=[token_id, token_id + 1], logprobs=[-0.25, -1.5], ranks=[1, 2])


def delta_items(delta: OutputDelta) -> int:
    """List items a delta carries: token ids and logprob positions of each sequence, the prompt's
    ids and the prompt positions with logprobs."""
    items = sum(len(c.token_ids) + len(c.logprobs or ()) for c in delta.outputs)
    items += len(delta.prompt.token_ids) if delta.prompt is not None else 0
    return items + len(delta.prompt_logprobs or ())


def stream(tokenizer: Tokenizer, num_prompt: int, num_output: int) -> tuple[RecordingFrontend, list[RequestOutput]]:
    """One request through the client core: prefill chunks with prompt logprobs (the last one
    with the first token), then one token per update."""
    frontend = RecordingFrontend(tokenizer, num_prompt + num_output)
    core = ClientCore(frontend, NoTransport(), "test")
    ids = clean_ids(tokenizer)
    prompt = [ids[i % len(ids)] for i in range(num_prompt)]
    params = SamplingParams(max_tokens=num_output, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    core._submit(frontend.prepare_tokens("long", None, prompt, params))
    outputs: list[RequestOutput] = []
    for start in range(1, num_prompt, PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, num_prompt)
        last = end == num_prompt
        update = RequestUpdate(request_id="long", new_token_ids=[ids[0]] if last else [],
                               logprobs=[entry(ids[0])] if last else None,
                               prompt_logprobs=[entry(prompt[p]) for p in range(start, end)],
                               prompt_logprobs_start=start)
        outputs += core._receive(RequestUpdates(step_id=0, updates=[update]))
    for position in range(1, num_output):
        token = ids[position % len(ids)]
        update = RequestUpdate(request_id="long", new_token_ids=[token], logprobs=[entry(token)],
                               finish_reason="length" if position == num_output - 1 else None)
        outputs += core._receive(RequestUpdates(step_id=0, updates=[update]))
    return frontend, outputs


def decode_deltas(frontend: RecordingFrontend, num_prompt: int) -> list[OutputDelta]:
    """The deltas after the prefill's: one per generated token after the first."""
    prefill_steps = -(-(num_prompt - 1) // PREFILL_CHUNK)
    return frontend.deltas[prefill_steps:]


@pytest.mark.parametrize(("num_prompt", "num_output"), [(1_000, 400), (100_000, 4_000)])
def test_each_streamed_update_carries_only_what_is_new(tokenizer: Tokenizer, num_prompt: int,
                                                       num_output: int) -> None:
    frontend, outputs = stream(tokenizer, num_prompt, num_output)
    deltas = frontend.deltas
    assert len(deltas) == len(outputs) and outputs[-1].finished
    # The prompt and its ids go once, in the first delta; its logprobs once each, as computed.
    assert deltas[0].prompt is not None and len(deltas[0].prompt.token_ids) == num_prompt
    assert all(delta.prompt is None for delta in deltas[1:])
    assert sum(len(delta.prompt_logprobs or ()) for delta in deltas) == num_prompt - 1
    assert all(len(delta.prompt_logprobs or ()) <= PREFILL_CHUNK for delta in deltas)
    # Every update after the prefill: one token and its logprobs, whatever came before.
    decoding = decode_deltas(frontend, num_prompt)
    assert len(decoding) == num_output - 1
    assert max(delta_items(delta) for delta in decoding) == PER_UPDATE_BOUND
    longest = max(len(tokenizer.decode([token_id])) for token_id in clean_ids(tokenizer))
    assert all(len(delta.outputs[0].text) <= longest for delta in decoding)  # one token's text
    assert sum(delta_items(delta) for delta in decoding) == PER_UPDATE_BOUND * (num_output - 1)


@pytest.mark.parametrize(("num_prompt", "num_output"), [(100_000, 4_000)])
def test_the_client_assembles_cumulative_outputs_without_copying(tokenizer: Tokenizer, num_prompt: int,
                                                                 num_output: int) -> None:
    frontend, outputs = stream(tokenizer, num_prompt, num_output)
    first, final = outputs[0], outputs[-1]
    completion = final.outputs[0]
    # The lists of every output are the ones of the first: grown in place, never copied.
    assert all(o.prompt_token_ids is first.prompt_token_ids for o in outputs)
    assert all(o.prompt_logprobs is first.prompt_logprobs for o in outputs)
    with_tokens = [o for o in outputs if o.outputs[0].token_ids]
    assert all(o.outputs[0].token_ids is completion.token_ids for o in with_tokens)
    assert all(o.outputs[0].logprobs is completion.logprobs for o in with_tokens)
    # ... and they add up to the whole request, as the cumulative outputs always did.
    assert len(completion.token_ids) == num_output and completion.finish_reason == "length"
    ids = clean_ids(tokenizer)
    assert completion.token_ids == [ids[position % len(ids)] for position in range(num_output)]
    assert completion.logprobs is not None and len(completion.logprobs) == num_output
    assert completion.cumulative_logprob == pytest.approx(-0.25 * num_output)
    assert completion.text == tokenizer.decode(completion.token_ids)
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == num_prompt
    assert final.prompt_logprobs[0] is None and all(p is not None for p in final.prompt_logprobs[1:])
    assert [not o.finished for o in outputs].count(True) == len(outputs) - 1


def test_a_request_that_ends_before_any_token_still_gets_its_prompt(tokenizer: Tokenizer) -> None:
    """The engine failing before the first token: the final delta is the first, with the prompt."""
    frontend = RecordingFrontend(tokenizer, 64)
    cumulative = CumulativeOutputs()
    frontend.submit(frontend.prepare_tokens("early", None, [5, 6, 7], SamplingParams(n=2, max_tokens=4)))
    (final,) = cumulative.add_all(frontend.fail_all("gone").to(CLIENT))
    assert final.finished and final.error == "gone" and final.prompt_token_ids == [5, 6, 7]
    assert [(c.index, c.token_ids, c.finish_reason) for c in final.outputs] == [(0, [], "error"), (1, [], "error")]
    assert len(cumulative) == 0


class NoAborts:
    def abort(self, request_id: str, reason: str = "abort") -> None:
        pass


@pytest.mark.asyncio
async def test_merged_streams_count_each_outputs_tokens_as_it_came() -> None:
    """Outputs of one request share their growing lists: an output queued behind the merge is read
    after later tokens came, so the server slices it up to the counts taken when it arrived."""
    frontend = Frontend(None, [0], max_model_len=64, vocab_size=97)
    core = ClientCore(frontend, NoTransport(), "test")
    prepared = [frontend.prepare_tokens(f"p{i}", None, [1, 2], SamplingParams(max_tokens=8)) for i in range(2)]
    for request in prepared:
        core._submit(request)
    streams = [RequestStream(NoAborts(), request) for request in prepared]

    def feed(index: int, tokens: list[int], finish: str | None = None) -> None:
        update = RequestUpdate(request_id=f"p{index}", new_token_ids=tokens, finish_reason=finish)
        for output in core._receive(RequestUpdates(step_id=0, updates=[update])):
            streams[index]._put(output)

    feed(0, [5])
    feed(1, [6])
    merged = merge_streams(streams)
    first = await anext(merged)  # both first outputs are queued by now
    feed(0, [7, 8], "length")
    feed(1, [9], "length")
    items = [first] + [item async for item in merged]
    # each step's mark: (text length, token count, finished); no tokenizer here, so no text
    (stale,) = [(output, mark) for index, output, mark in items if index == 1 and not output.finished]
    assert stale[1] == {0: (0, 1, False)} and stale[0].outputs[0].token_ids == [6, 9]  # read after its list grew
    finals = {index: (output.outputs[0].token_ids, mark) for index, output, mark in items if output.finished}
    assert finals == {0: ([5, 7, 8], {0: (0, 3, True)}), 1: ([6, 9], {0: (0, 2, True)})}


@pytest.mark.asyncio
async def test_a_stream_read_late_still_yields_each_output_step() -> None:
    """Three outputs put before the reader came: one item per output, each with where it left the
    sequence (a slow consumer of a stream still sends a chunk per engine step)."""
    frontend = Frontend(None, [0], max_model_len=64, vocab_size=97)
    core = ClientCore(frontend, NoTransport(), "test")
    request = frontend.prepare_tokens("q", None, [1, 2], SamplingParams(max_tokens=3))
    core._submit(request)
    stream = RequestStream(NoAborts(), request)
    for token, finish in ((5, None), (6, None), (7, "length")):
        update = RequestUpdate(request_id="q", new_token_ids=[token], finish_reason=finish)
        for output in core._receive(RequestUpdates(step_id=0, updates=[update])):
            stream._put(output)
    items = [item async for item in merge_streams([stream])]
    assert [mark for _, _, mark in items] == [{0: (0, 1, False)}, {0: (0, 2, False)}, {0: (0, 3, True)}]
    assert all(output.finished for _, output, _ in items)  # the latest output, read once for all three
