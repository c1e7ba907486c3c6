"""Adaptive drafting through the in-process engine (a draft model's path: the fake model as its own
draft, right or wrong by rule), each step's time taken from a fake clock the runners advance by a
set cost: a target step a fixed cost plus a cost per token, a draft pass its own. Nothing here
depends on the machine's speed.

Drafts that are always wrong stop within a few steps, apart from bounded probes; drafts that are
always right go on; in a mixed batch each request gets what its drafts earn; a draft pass as slow
as the target stops drafting even at moderate acceptance. The outputs are those of no speculation.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from tests.engine.test_spec_decode import CopyingRunner, run
from tests.engine.test_spec_decode_draft import FakeDraft
from vllm_actors.actors.scheduler.spec_probes import PROBE_INTERVAL
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import Finished, StepFinished
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

STEP_SECONDS = 0.010  # a target step: memory-bound, nearly all fixed cost
TOKEN_SECONDS = 0.0001


class ClockedRunner(CopyingRunner):
    """The fake model; each step advances ``now`` by its cost."""

    now = 0.0
    token_seconds = TOKEN_SECONDS

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.now += STEP_SECONDS + self.token_seconds * len(batch.token_ids)
        return super().execute(batch)


class RuledDraft(FakeDraft):
    """The target's function as a draft, wrong (off by one) where ``wrong(context)``; each pass
    advances the target's clock by ``pass_seconds``."""

    def __init__(self, target: ClockedRunner, wrong: Callable[[list[int]], bool], pass_seconds: float) -> None:
        super().__init__(target, errs=False)
        self.wrong, self.pass_seconds = wrong, pass_seconds

    def next_token(self, context: list[int]) -> int:
        token = CopyingRunner.next_token(self, context)
        return (token + 1) % self.vocab_size if self.wrong(context) else token

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.target.now += self.pass_seconds  # type: ignore[attr-defined]  # a ClockedRunner
        return super().execute(batch)


def paced_engine(wrong: Callable[[list[int]], bool] | None, pass_seconds: float = 0.0005,
                 token_seconds: float = TOKEN_SECONDS) -> tuple[InProcessEngine, list[StepFinished], list[Finished]]:
    runner = ClockedRunner(num_blocks=256, block_size=4)
    runner.token_seconds = token_seconds
    spec = None
    if wrong is not None:
        runner.drafter = RuledDraft(runner, wrong, pass_seconds)  # type: ignore[attr-defined]  # read by build_worker
        spec = parse_speculative_config({"method": "draft_model", "model": "fake", "num_speculative_tokens": 3})
    config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=64, max_model_len=512,
                          speculative_config=spec)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.worker.clock = lambda: runner.now  # step times from the fake clock only
    engine.step_hooks.append(lambda e: e.check_invariants())
    steps: list[StepFinished] = []
    finished: list[Finished] = []

    def listen(batch):  # type: ignore[no-untyped-def]
        steps.extend(e for e in batch.events if isinstance(e, StepFinished))
        finished.extend(e for e in batch.events if isinstance(e, Finished))

    engine.event_listeners.append(listen)
    return engine, steps, finished


PROMPTS = [[1 + i, *((i * 5 + j * 3) % 97 for j in range(8))] for i in range(4)]  # the first token: odd or even
OUTPUT = 160
PARAMS = [SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)] * len(PROMPTS)
EXPECTED: dict[str, list[int]] = {}


def expected() -> dict[str, list[int]]:
    if not EXPECTED:
        EXPECTED.update(run(paced_engine(None)[0], PROMPTS, PARAMS))
    return EXPECTED


def always(context: list[int]) -> bool:
    return True


def never(context: list[int]) -> bool:
    return False


def test_always_wrong_drafts_stop_apart_from_bounded_probes() -> None:
    engine, steps, _ = paced_engine(always)
    assert run(engine, PROMPTS, PARAMS) == expected()
    drafted = [step.num_draft_tokens for step in steps]
    assert sum(step.num_accepted_tokens for step in steps) == 0
    warmup = 8
    assert sum(drafted[:warmup]) > 0  # it tried (the prior)
    later = drafted[warmup:]
    # afterwards only probes: one draft per request per half interval of its plain steps at most
    assert max(later) <= len(PROMPTS)
    assert sum(later) <= len(PROMPTS) * (OUTPUT // (PROBE_INTERVAL // 2) + 1)
    assert sum(drafted) <= 0.1 * OUTPUT * len(PROMPTS)


def test_always_right_drafts_go_on() -> None:
    engine, steps, _ = paced_engine(never)
    assert run(engine, PROMPTS, PARAMS) == expected()
    accepted = sum(step.num_accepted_tokens for step in steps)
    assert accepted == sum(step.num_draft_tokens for step in steps)
    assert accepted >= 0.6 * OUTPUT * len(PROMPTS)  # most tokens came as accepted drafts


def test_a_mixed_batch_drafts_for_the_requests_whose_drafts_are_right() -> None:
    """Requests of an odd first token get wrong drafts, the others right ones. Verified tokens cost
    enough here (2 ms each) that the wrong ones' drafts cost more than the plain step they run in
    between the others' drafting steps (two steps in flight); where drafts cost less than that
    step, drafting for all of them is the faster plan (``test_spec_decode_parts``)."""
    engine, _, finished = paced_engine(lambda context: context[0] % 2 == 1, token_seconds=0.002)
    assert run(engine, PROMPTS, PARAMS) == expected()
    by_parity = {0: [0, 0], 1: [0, 0]}
    for event in finished:
        drafted_accepted = by_parity[PROMPTS[int(event.request_id)][0] % 2]
        drafted_accepted[0] += event.num_draft_tokens
        drafted_accepted[1] += event.num_accepted_tokens
    assert by_parity[0][1] >= 0.5 * OUTPUT * 2
    assert by_parity[1][1] == 0 and by_parity[1][0] <= 0.1 * OUTPUT * 2


def moderately_wrong(context: list[int]) -> bool:
    return zlib.crc32(bytes(context)) % 3 == 0  # about one draft in three wrong


def test_a_costly_draft_stops_drafting_at_moderate_acceptance() -> None:
    """The same drafts (about two in three right) are worth a cheap draft pass but not one as slow
    as the target's step: the measured extra cost of drafting steps decides."""
    accepted = {}
    for pass_seconds in (0.0005, STEP_SECONDS):
        engine, steps, _ = paced_engine(moderately_wrong, pass_seconds)
        assert run(engine, PROMPTS, PARAMS) == expected()
        assert sum(step.num_accepted_tokens for step in steps) > 0
        accepted[pass_seconds] = sum(step.num_draft_tokens for step in steps[8:])
    assert accepted[0.0005] >= 0.3 * OUTPUT * len(PROMPTS)
    assert accepted[STEP_SECONDS] <= 0.1 * OUTPUT * len(PROMPTS)


def test_text_that_becomes_predictable_is_drafted_for_again() -> None:
    """Drafts wrong for the first 40 tokens of each output, right afterwards: drafting stops, a
    probe (within its share of the time) finds the drafts right, and drafting resumes."""
    params = [SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)] * len(PROMPTS)
    engine, steps, _ = paced_engine(lambda context: len(context) < len(PROMPTS[0]) + 40)
    assert run(engine, PROMPTS, params) == run(paced_engine(None)[0], PROMPTS, params)
    stopped = [step.num_draft_tokens for step in steps[10:60]]
    assert max(stopped) == 0
    assert sum(step.num_accepted_tokens for step in steps[60:]) >= 100
