"""One long request through the control plane in process, chunk by chunk: the scheduler and the
KV-cache manager (prefix caching on), every message through the msgspec codec as on the wire, the
worker's reply faked (one token when the prefill completes). For each chunk: the bytes of the plan
(scheduler -> KV-cache manager), of the plan forwarded to the workers, of the step result and of the
chunk's event batch (both actors' events), and the CPU time of all of it (``time.process_time``)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import cast

import msgspec

from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import EventBatch
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER, WORKER
from vllm_actors.protocol.sampling import SamplingParams

BLOCK_SIZE = 16


@dataclass(frozen=True)
class ChunkCost:
    computed: int  # the request's computed tokens once the step is done
    num_tokens: int  # computed by the step (a decode: 1)
    plan_bytes: int
    forwarded_bytes: int
    result_bytes: int
    event_bytes: int
    cpu_seconds: float


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """Random token ids; a longer prompt starts with a shorter one's tokens (same seed)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(length)]


def run_long_request(prompt: list[int], chunk: int, num_blocks: int, max_tokens: int = 1) -> list[ChunkCost]:
    """The request's prefill in chunks of ``chunk`` tokens, then its decode steps."""
    config = SchedulerConfig(max_model_len=len(prompt) + 8, max_num_seqs=8, max_num_batched_tokens=chunk,
                             enable_chunked_prefill=True, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                             max_steps_in_flight=1)
    scheduler = Scheduler(config)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    codec = MessageCodec()
    kv_codec = MessageCodec.for_actor(KV_CACHE_MANAGER)
    events = msgspec.msgpack.Encoder()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = scheduler.handle(AddRequest(request_id="long", prompt_token_ids=prompt, params=params, eos_token_ids=[0]))
    costs: list[ChunkCost] = []
    while True:
        plans = [m for m in out.to(KV_CACHE_MANAGER) if isinstance(m, StepPlan)]
        if not plans:
            return costs
        (plan,) = plans
        started = time.process_time()
        plan_wire = codec.encode(plan)
        manager_out = manager.handle(cast(StepPlan, kv_codec.decode(plan_wire)))
        (forwarded,) = manager_out.to(WORKER)
        forwarded_wire = codec.encode(forwarded)
        codec.decode(forwarded_wire)
        request = scheduler.requests.get("long")
        sampled = ["long"] if request is not None and request.num_pending else []
        result = StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=sampled, token_ids=[7] * len(sampled))
        result_wire = codec.encode(result)
        batch = EventBatch(actor="scheduler", first_seq=0, mono=0.0, wall=0.0, events=out.events + manager_out.events)
        event_wire = events.encode(batch)
        next_out = scheduler.handle(cast(StepResult, codec.decode(result_wire)))
        cpu = time.process_time() - started
        computed = request.num_computed_tokens if request is not None else 0
        costs.append(ChunkCost(computed, sum(plan.num_tokens), len(plan_wire), len(forwarded_wire), len(result_wire),
                               len(event_wire), cpu))
        out = next_out

