"""The host work per step of a batch of decoding requests, with and without n-gram speculation
(adaptive, as served), in the in-process engine on the CPU (``benchmarks/spec_round_trip.py --batch N``).

The fake model copies its context with period ``PERIOD`` except at one position in ``GLITCH``
(n-gram drafts are mostly right, as on a prompt-copying workload); each step advances a fake clock
by a device model's cost, which is what the policy measures (so it decides as on a GPU where
drafting does not pay at this batch size): a plain step ``plain`` plus ``per_request`` a request, a
verifying step ``verify`` more plus ``per_token`` a drafted token, and a step launched with nothing
in flight (the pipeline drained: its inputs prepared while the device idled) ``switch`` more.
Counted: the steps launched with the pipeline drained, the plans with ``WORKER_DRAFT``
placeholders, and each actor's host microseconds per step (the fake model's time left out; CPU
time of the thread, so that other processes sharing the cores count less).
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from tests.support.fake_runner import FakeRunner

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

PERIOD = 61
GLITCH = 5
MS = 1e-3


@dataclass
class DeviceCosts:
    """Seconds of a step on the device (the H200's SmolLM2-135M at 64 requests: about 1.6 ms)."""

    plain: float = 0.9 * MS
    per_request: float = 0.011 * MS
    verify: float = 0.6 * MS
    per_token: float = 0.01 * MS
    switch: float = 0.3 * MS

    def step(self, batch: BatchInput) -> float:
        seconds = self.plain + self.per_request * len(batch.query_lens)
        drafted = len(batch.token_ids) - len(batch.query_lens)
        if drafted:
            seconds += self.verify + self.per_token * drafted
        elif batch.deferred is None:  # nothing in flight: the device idled while it was prepared
            seconds += self.switch
        return seconds


class CopyingClockedRunner(FakeRunner):
    """Next token: the context's token ``PERIOD`` back, except at hashed positions; takes deferred
    inputs from the device tensor (two steps in flight) and advances ``now`` by the device's cost."""

    supports_deferred_inputs = True
    now = 0.0
    model_seconds = 0.0
    drained = 0
    steps = 0
    costs = DeviceCosts()

    def execute(self, batch: BatchInput) -> torch.Tensor:
        start = time.thread_time()
        token_ids = list(batch.token_ids)
        if batch.deferred is not None:
            sampled = batch.deferred.source.tolist()
            for index, row in zip(batch.deferred.flat_index, batch.deferred.source_row, strict=True):
                token_ids[index] = sampled[row]
        decode = len(token_ids) == len(batch.query_lens) or len(token_ids) > len(batch.query_lens) and all(
            q <= 8 for q in batch.query_lens)
        if decode:
            self.now += self.costs.step(batch)
            self.steps += 1
            self.drained += batch.deferred is None
        logits = torch.zeros((len(batch.logits_indices), self.vocab_size))
        for row, index in enumerate(batch.logits_indices):
            position, token = batch.positions[index], token_ids[index]
            if zlib.crc32(position.to_bytes(4, "little") + token.to_bytes(4, "little")) % GLITCH == 0:
                logits[row, (token * 7 + position) % (self.vocab_size - 1) + 1] = 10.0
            else:
                logits[row, token % PERIOD + 1] = 10.0  # the successor in a cycle of PERIOD tokens
        self.model_seconds += time.thread_time() - start
        return logits


def measure(batch: int, num_spec: int, output_len: int, costs: DeviceCosts | None = None,
            warm: int = 1) -> dict[str, Any]:
    """``warm`` batch-1 requests first (the policy learns batch 1's costs, as a server has), then
    ``batch`` requests at once: per step, each actor's host microseconds, and the counts."""
    runner = CopyingClockedRunner(num_blocks=batch * 48 + 64, block_size=16, vocab_size=PERIOD + 2)
    runner.costs = costs or DeviceCosts()
    spec = ({"method": "ngram", "num_speculative_tokens": num_spec, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
            if num_spec else None)
    config = EngineConfig(model="fake", block_size=16, max_num_seqs=max(batch, 1), max_num_batched_tokens=8192,
                          max_model_len=2048, enable_prefix_caching=False,
                          speculative_config=parse_speculative_config(spec, adaptive=True) if spec else None)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.worker.clock = lambda: runner.now  # step times from the device model only
    worker = engine.worker
    worker.pending_ready = lambda: worker._pending is None  # type: ignore[method-assign]  # a device still running it
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)

    def prompt(index: int) -> list[int]:
        return [(index + p) % PERIOD + 1 for p in range(3 * PERIOD)]

    for index in range(warm):
        engine.submit(engine.prepare(f"warm-{index}", {"prompt_token_ids": prompt(index)}, params))
        while engine.has_unfinished:
            engine.step()
    seconds: dict[str, float] = defaultdict(float)
    placeholders = [0, 0]  # plans with WORKER_DRAFT placeholders, their placeholders

    for loop in engine._loops:
        receive, name = loop.receive, loop.actor.name

        def timed_receive(sender: bytes, message: Any, receive: Any = receive, name: str = name) -> Any:
            if name == "worker" and isinstance(message, StepPlan) and message.draft_token_ids:
                placeholders[0] += 1
                placeholders[1] += sum(map(len, message.draft_token_ids.values()))
            model, start = runner.model_seconds, time.thread_time()
            try:
                return receive(sender, message)
            finally:
                seconds[f"{name} <- {type(message).__name__}"] += (time.thread_time() - start
                                                                   - (runner.model_seconds - model))

        loop.receive = timed_receive  # type: ignore[method-assign]  # timing only
    spec = engine.scheduler.spec
    if spec is not None:  # the scheduler's time in the speculator's per-pass methods (inside its StepResult's)
        for method in ("begin_pass", "account", "trim", "take_trims"):  # (drafts, per request: timing it costs more)
            original = getattr(spec, method)

            def timed(*args: Any, original: Any = original) -> Any:
                start = time.thread_time()
                try:
                    return original(*args)
                finally:
                    seconds["  of which the speculator's"] += time.thread_time() - start

            setattr(spec, method, timed)
    steps_before, drained_before, now_before = runner.steps, runner.drained, runner.now
    for index in range(batch):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt(index)}, params))
    while engine.has_unfinished:
        engine.step()
    steps = runner.steps - steps_before
    counters = spec.counters if spec is not None else None
    return {
        "steps": steps,
        "drained": runner.drained - drained_before,
        "plans_with_placeholders": placeholders[0],
        "placeholders": placeholders[1],
        "drafts": counters.num_drafts if counters else 0,
        "device_ms": (runner.now - now_before) * 1e3,
        "us_per_step": {key: 1e6 * value / steps for key, value in sorted(seconds.items())},
    }
