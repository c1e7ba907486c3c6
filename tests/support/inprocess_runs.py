"""Requests run to completion on an in-process engine over a given model runner, with the ledger's
invariant checks after every step and at the end (engine tests of the runner's step paths)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.model_runner import ModelRunner


def output_token_ids(config: EngineConfig, runner: ModelRunner, prompts: Sequence[list[int]],
                     params: Sequence[SamplingParams]) -> list[list[int]]:
    """Each prompt's output tokens (request ids "0", "1", ... in order; one parameter set a prompt)."""
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt}, sampling))
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished:
        finished.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    engine.check_idle_invariants()
    return [finished[str(index)] for index in range(len(prompts))]
