"""The KV-cache manager decodes plans as ``PassThroughPlan``: a new request's sampling parameters
and EOS ids stay raw msgpack (never built nor validated there) and reach the worker unchanged."""

from __future__ import annotations

import msgspec

from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.messages import AbortRequests, NewRequest, PassThroughPlan, StepPlan
from vllm_actors.protocol.names import KV_CACHE_MANAGER, WORKER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids
from vllm_actors.runtime.transport import InMemoryNetwork

PARAMS = SamplingParams(temperature=0.5, top_p=0.9, seed=7, stop=["x"], logprobs=2, max_tokens=9)


def plan() -> StepPlan:
    new = NewRequest(request_id="a", token_ids=pack_token_ids(range(10)), num_prompt_tokens=10, num_output_tokens=0,
                     params=PARAMS, eos_token_ids=[2, 3])
    return StepPlan(step_id=0, new_requests=[new], req_ids=["a"], num_tokens=[10], num_blocks=[3])


def test_the_kv_manager_forwards_sampling_parameters_raw_and_the_worker_gets_them_intact() -> None:
    wire = MessageCodec().encode(plan())
    kv_codec = MessageCodec.for_actor(KV_CACHE_MANAGER)
    viewed = kv_codec.decode(wire)
    assert isinstance(viewed, PassThroughPlan) and kv_codec.protocol_type(viewed) is StepPlan
    assert isinstance(viewed.new_requests[0].params, msgspec.Raw)
    assert isinstance(viewed.new_requests[0].eos_token_ids, msgspec.Raw)
    assert viewed.new_requests[0].num_tokens == 10
    assert kv_codec.decode(MessageCodec().encode(AbortRequests(request_ids=["x"]))) == AbortRequests(request_ids=["x"])
    (_, forwarded), *_ = KVCacheManager(num_blocks=8, block_size=4).handle(viewed).messages
    at_worker = MessageCodec.for_actor(WORKER).decode(MessageCodec().encode(forwarded))
    assert type(at_worker) is StepPlan
    assert at_worker == msgspec.structs.replace(plan(), new_block_ids=[[0, 1, 2]])
    assert at_worker.new_requests[0].params == PARAMS


def test_the_manager_takes_live_plans_too_and_the_in_memory_network_decodes_as_each_actor() -> None:
    (_, forwarded), *_ = KVCacheManager(num_blocks=8, block_size=4).handle(plan()).messages
    assert forwarded == msgspec.structs.replace(plan(), new_block_ids=[[0, 1, 2]])
    network = InMemoryNetwork(serialize=True)
    kv, worker = network.endpoint(KV_CACHE_MANAGER), network.endpoint(WORKER)
    worker.send(KV_CACHE_MANAGER, plan())
    assert isinstance(kv.recv(), PassThroughPlan)
    kv.send(WORKER, plan())
    assert type(worker.recv()) is StepPlan
