"""Pipeline parallelism without processes: the layer split of the stages (and its setting), the
engine argument's checks, and the scheduler's micro-batches - a long prompt's chunks planned back
to back (sequence pipeline parallelism), a request's decodes never overlapping themselves, its
last sampled token carried to the stages before the last."""

from __future__ import annotations

import pytest

from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.engine_args import make_engine_config
from vllm_actors.models.pipeline import PipelineStage
from vllm_actors.models.stage_split import stage_layers
from vllm_actors.protocol.config import EngineConfig, SchedulerConfig, resolve_scheduler_config
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams


def test_even_split_gives_the_first_stages_the_extra_layers() -> None:
    assert stage_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    assert stage_layers(5, 2, "1,4") == [(0, 1), (1, 5)]


@pytest.mark.parametrize("partition", ["1,2", "2,2,2", "0,5", "a,b"])
def test_a_partition_that_does_not_fit_is_refused(partition: str) -> None:
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION"):
        stage_layers(5, 2, partition)


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="larger than the model's 3 layers"):
        stage_layers(3, 4)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        EngineConfig(model="m", pipeline_parallel_size=0)



def test_lora_and_speculation_are_refused_under_pipeline_parallelism() -> None:
    with pytest.raises(ValueError, match="enable_lora does not compose with pipeline_parallel_size > 1"):
        EngineConfig(model="m", pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="speculative_config does not compose with pipeline_parallel_size > 1"):
        EngineConfig(model="m", pipeline_parallel_size=2,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_stage_loads_only_its_checkpoint_tensors() -> None:
    first, last = PipelineStage(stage=0, size=2, start=0, end=2), PipelineStage(stage=1, size=2, start=2, end=3)
    assert first.owns("model.embed_tokens.weight", 3) and not last.owns("model.embed_tokens.weight", 3)
    assert last.owns("lm_head.weight", 3) and last.owns("model.norm.weight", 3) and not first.owns("lm_head.weight", 3)
    assert first.owns("model.layers.1.mlp.up_proj.weight", 3) and not first.owns("model.layers.2.mlp.up_proj.weight", 3)
    assert last.owns("model.layers.2.self_attn.q_proj.weight", 3)


def test_the_stages_set_the_micro_batches_in_flight() -> None:
    config = make_engine_config("m", {"pipeline_parallel_size": 3, "tensor_parallel_size": 2})
    assert config.world_size == 6 and config.answering_rank == 4
    scheduler = resolve_scheduler_config(config, 1024, num_blocks=100)
    assert scheduler.max_steps_in_flight == 4 and scheduler.pipeline_parallel_size == 3  # P + 1 under async
    sync = make_engine_config("m", {"pipeline_parallel_size": 3, "async_scheduling": False})
    assert resolve_scheduler_config(sync, 1024, num_blocks=100).max_steps_in_flight == 3


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=16,
                                     enable_chunked_prefill=True, block_size=4, num_blocks=200,
                                     max_steps_in_flight=3, enable_prefix_caching=False, pipeline_parallel_size=2))


def _add(request_id: str, prompt_len: int) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=list(range(1, prompt_len + 1)),
                      params=SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=[0])


def _plans(out: Outputs) -> list[StepPlan]:
    return [message for message in out.to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]


def _result(plan: StepPlan, sampled: dict[str, int]) -> StepResult:
    return StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=list(sampled), token_ids=list(sampled.values()))


def test_a_long_prompts_chunks_enter_back_to_back_and_its_decodes_wait_for_their_token() -> None:
    scheduler = _scheduler()
    chunks = _plans(scheduler.handle(_add("long", 40)))
    # three chunks in flight at once: none waits for the one before it (it samples nothing); of
    # equal predicted time within the budget of 16 (the prior's attention term is small here)
    assert [(plan.req_ids, plan.num_tokens) for plan in chunks] == [(["long"], [n]) for n in (13, 14, 13)]
    assert _plans(scheduler.handle(_add("short", 4))) == []  # the pipeline is full
    # the first chunk's result frees a slot: the short prompt enters; "long" waits for its token
    (second,) = _plans(scheduler.handle(_result(chunks[0], {})))
    assert second.req_ids == ["short"]
    assert _plans(scheduler.handle(_result(chunks[1], {}))) == []  # both wait for their tokens
    (decode,) = _plans(scheduler.handle(_result(chunks[2], {"long": 9})))
    assert decode.req_ids == ["long"] and decode.num_tokens == [1]
    assert decode.input_token_ids == {"long": 9}  # the stages before the last learn their input
    (short,) = _plans(scheduler.handle(_result(second, {"short": 5})))
    assert short.req_ids == ["short"] and short.input_token_ids == {"short": 5}


def test_an_earlier_stages_step_event_does_not_count_the_step_again() -> None:
    from tests.state_machines.test_metrics_store import Bus, summary
    from vllm_actors.actors.metrics_store.store import MetricsStore
    from vllm_actors.protocol.events import StepFinished

    store = MetricsStore()
    bus = Bus(store)
    bus.publish("worker-0", StepFinished(step_id=0, num_seqs=1, num_tokens=64, num_sampled=0, execute_ms=5.0, stage=0))
    bus.publish("worker-1", StepFinished(step_id=0, num_seqs=1, num_tokens=64, num_sampled=1, execute_ms=6.0))
    reply = summary(store)
    assert reply.steps == 1


def test_the_decodes_are_shared_out_evenly_over_the_micro_batches() -> None:
    # Prompts prefilled in one step would decode as one micro-batch beside empty ones (a step takes
    # every request that is ready): each micro-batch takes its share of the decoding requests.
    scheduler = _scheduler()
    chunks = _plans(scheduler.handle(_add("long", 40)))  # three chunks fill the pipeline
    ids = [f"r{index}" for index in range(6)]
    for request_id in ids:
        assert _plans(scheduler.handle(_add(request_id, 2))) == []
    (prefill,) = _plans(scheduler.handle(_result(chunks[0], {})))
    assert sorted(prefill.req_ids) == ids
    assert _plans(scheduler.handle(_result(chunks[1], {}))) == []
    (decode,) = _plans(scheduler.handle(_result(chunks[2], {"long": 9})))
    assert decode.req_ids == ["long"]
    # seven decoding, two stages: a micro-batch of at most four beside the long prompt's in flight;
    # the other two wait for the long prompt's micro-batch rather than decode in a third
    (first,) = _plans(scheduler.handle(_result(prefill, {request_id: 7 for request_id in ids})))
    assert first.req_ids == ids[:4]
    (second,) = _plans(scheduler.handle(_result(decode, {"long": 10})))
    assert second.req_ids == ["long", *ids[4:]]
    (again,) = _plans(scheduler.handle(_result(first, {request_id: 8 for request_id in first.req_ids})))
    assert again.req_ids == first.req_ids
