"""The control plane alone: the scheduler and the KV-cache manager replaying a workload of
requests that share a system prompt, with no model (the worker's reply is one token per sampling
request), every message through the msgspec codec as on the wire (each actor's decoder). Reports the CPU milliseconds
each actor spends per step, to see what admissions with prefix-cache hits cost.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from typing import cast

from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class StepCost:
    step_id: int
    num_requests: int
    num_tokens: int
    num_new: int
    scheduler_ms: float  # handling the step result that produced this plan (planning included)
    kv_manager_ms: float  # assign_blocks on the decoded plan
    codec_ms: float  # encoding and decoding the plan, twice (scheduler -> KV manager -> worker)


def replay(num_requests: int, system_tokens: int, steps: int, prefix_caching: bool, seed: int = 0) -> list[StepCost]:
    config = SchedulerConfig(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
                             enable_chunked_prefill=True, block_size=16, num_blocks=30_000,
                             enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(config)
    manager = KVCacheManager(config.num_blocks, config.block_size)
    codec = MessageCodec()  # the worker's
    kv_codec = MessageCodec.for_actor(KV_CACHE_MANAGER)  # sampling parameters pass through raw
    rng = random.Random(seed)
    system = [rng.randrange(10_000) for _ in range(system_tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    pending: list[tuple[StepPlan, float, float, float]] = []

    def deliver(outputs: Outputs, scheduler_ms: float) -> None:
        for message in outputs.to(KV_CACHE_MANAGER):
            if not isinstance(message, StepPlan):
                continue
            started = time.perf_counter()
            plan = cast(StepPlan, kv_codec.decode(codec.encode(message)))
            decoded = time.perf_counter()
            assigned = manager.assign_blocks(plan, [])
            done = time.perf_counter()
            codec.decode(codec.encode(assigned))
            codec_ms = (decoded - started + time.perf_counter() - done) * 1e3
            pending.append((assigned, scheduler_ms, (done - decoded) * 1e3, codec_ms))

    for index in range(num_requests):
        prompt = system + [rng.randrange(10_000) for _ in range(rng.randint(20, 100))]
        deliver(scheduler.handle(AddRequest(request_id=str(index), prompt_token_ids=prompt, params=params,
                                            eos_token_ids=[0])), 0.0)
    costs: list[StepCost] = []
    while pending and len(costs) < steps:
        plan, scheduler_ms, kv_ms, codec_ms = pending.pop(0)
        costs.append(StepCost(plan.step_id, len(plan.req_ids), sum(plan.num_tokens), len(plan.new_requests),
                              scheduler_ms, kv_ms, codec_ms))
        started = time.perf_counter()
        outputs = scheduler.handle(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=list(plan.req_ids),
                                              token_ids=[1] * len(plan.req_ids)))
        deliver(outputs, (time.perf_counter() - started) * 1e3)
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    args = parser.parse_args(argv)
    costs = replay(args.num_requests, args.system_tokens, args.steps, args.prefix_caching)
    sys.stdout.write("step | requests | tokens | new | scheduler ms | KV manager ms | codec ms\n")
    for cost in costs:
        sys.stdout.write(f"{cost.step_id:4d} | {cost.num_requests:8d} | {cost.num_tokens:6d} | {cost.num_new:3d} | "
                         f"{cost.scheduler_ms:12.1f} | {cost.kv_manager_ms:13.1f} | {cost.codec_ms:8.1f}\n")
    return 0

