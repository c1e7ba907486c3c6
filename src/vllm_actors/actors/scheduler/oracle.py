"""The oracle drafter (speculative ``method: oracle``, benchmarks only): drafts from the target's own
greedy continuation of each prompt, each drafted token right with a set probability, so that a
benchmark measures the verification cost at a chosen acceptance.

Whether the token at output position ``p`` of a prompt is drafted right is one seeded draw per
(seed, prompt, ``p``), the same whatever the step it falls in. A step drafting from ``p`` proposes the
continuation's tokens while their draws say right; from the first wrong one on it proposes tokens that
are certainly not the continuation's. Every position a step reaches is accepted with the set
probability and reached once (the step after a rejection starts past it), so accepted over reached
positions measures it.

The continuations come with the config (recorded by a run without speculation) and are learnt from
every finished request: where a request's greedy output left the continuation (on a GPU, a verification
step's rounding may differ from a decode step's at a near tie) it replaces it, so a prompt run again
drafts from what the target outputs under these very drafts. A request stops drafting where its output
leaves the continuation; the output stays exact either way (drafts are verified).
"""

from __future__ import annotations

import random
import zlib

from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.protocol.speculative import SpeculativeConfig
from vllm_actors.protocol.token_ids import pack_token_ids


def wrong_token(token: int) -> int:
    """A token id other than ``token`` (any vocabulary holds both)."""
    return token + 1 if token == 0 else token - 1


class OracleDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.acceptance = config.oracle_acceptance
        self.seed = config.oracle_seed
        self._truth: dict[bytes, list[int]] = {
            pack_token_ids(list(prompt)): list(continuation) for prompt, continuation in config.oracle_tokens}
        self._draws: dict[bytes, tuple[random.Random, list[bool]]] = {}
        self._checked: dict[str, int] = {}  # request id -> its outputs known equal to the continuation (-1: left it)

    def right(self, prompt: bytes, position: int) -> bool:
        """Whether the draft at output ``position`` of ``prompt``'s continuation is drafted right."""
        if prompt not in self._draws:
            self._draws[prompt] = (random.Random(self.seed * 2**32 + zlib.crc32(prompt)), [])
        rng, draws = self._draws[prompt]
        while len(draws) <= position:
            draws.append(rng.random() < self.acceptance)
        return draws[position]

    def propose(self, request: ScheduledRequest, num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` tokens after ``request``'s outputs ([]: no continuation known there)."""
        truth = self._truth.get(request.packed_prompt)
        outputs = request.output_token_ids
        position = len(outputs)
        checked = self._checked.get(request.request_id, 0)
        if truth is None or checked < 0:
            return []
        if outputs[checked:position] != truth[checked:position]:
            self._checked[request.request_id] = -1  # it left the continuation: nothing to replay
            return []
        self._checked[request.request_id] = position
        drafts: list[int] = []
        wrong = False
        for token in truth[position : position + num_drafts]:
            wrong = wrong or not self.right(request.packed_prompt, position + len(drafts))
            drafts.append(wrong_token(token) if wrong else token)
        return drafts

    def learn(self, request: ScheduledRequest) -> None:
        """A finished greedy request: its outputs become its prompt's continuation unless they are a
        prefix of it."""
        self._checked.pop(request.request_id, None)
        if not request.params.greedy:
            return
        outputs = request.output_token_ids
        truth = self._truth.get(request.packed_prompt)
        if truth is None or truth[: len(outputs)] != outputs:
            self._truth[request.packed_prompt] = list(outputs)
