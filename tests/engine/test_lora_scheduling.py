"""LoRA in the scheduler, with a fake model: no step uses more adapters than ``max_loras`` (a
request whose adapter would be one more waits, and the requests behind it go first, as vLLM), every
request finishes, and a request naming an adapter is refused by an engine without LoRA."""

from __future__ import annotations

import dataclasses

from tests.support.fake_runner import FakeRunner
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _engine(enable_lora: bool) -> tuple[InProcessEngine, FakeRunner]:
    runner = FakeRunner(num_blocks=64, block_size=4)
    config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=64, max_model_len=128,
                          enable_lora=enable_lora, max_loras=1)
    engine = InProcessEngine(config, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    return engine, runner


def _submit(engine: InProcessEngine, index: int, lora: LoRARequest | None) -> None:
    prepared = engine.prepare(str(index), {"prompt_token_ids": [10 + index, 20, 30, 40, 50]}, PARAMS)
    engine.submit(dataclasses.replace(prepared, lora_request=lora))


def test_a_step_uses_at_most_max_loras_adapters() -> None:
    engine, runner = _engine(enable_lora=True)
    one, two = LoRARequest("one", 1, "/one"), LoRARequest("two", 2, "/two")
    for index, lora in enumerate((one, two, None, one)):
        _submit(engine, index, lora)
    finished = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert sorted(finished) == ["0", "1", "2", "3"] and all(o.error is None for o in finished.values())
    used = [{lora.lora_int_id for lora in batch.loras or () if lora is not None} for batch in runner.batches]
    assert all(len(ids) <= 1 for ids in used)
    assert {1} in used and {2} in used
    order = list(finished)  # "two" waited while "one" ran; the "one" behind it went first
    assert order.index("3") < order.index("1")


def test_an_adapter_without_enable_lora_is_refused() -> None:
    engine, _ = _engine(enable_lora=False)
    _submit(engine, 0, LoRARequest("one", 1, "/one"))
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert outputs[-1].finished and "LoRA is not enabled" in (outputs[-1].error or "")
