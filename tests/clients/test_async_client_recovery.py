"""Recovery in the asyncio client: owning a group, it sends its unfinished requests again after a
scheduler restart and ends every open stream with an error when the group fails; attached (no group
of its own), it follows the supervisor's events on the bus and nobody else's. A fake scheduler on a
real socket stands in for the scheduler process, a fake process group for the supervisor."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.fake_env import PROMPTS, FakeBus
from tests.support.fake_scheduler import Env, expected_tokens, wait_until_async
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.core import EngineDeadError
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.protocol.events import ActorFailed, ActorRestarted, GroupFailed
from vllm_actors.protocol.names import SCHEDULER, SUPERVISOR


async def collect(stream: RequestStream) -> list[RequestOutput]:
    return [output async for output in stream]


@pytest.mark.asyncio
async def test_async_client_resubmits_and_fails_with_its_owned_group(env: Env) -> None:
    client = AsyncEngineClient(env.info, env.tokenizer, group=env.group, load_tokenizer=False)
    failures: list[str] = []
    client.add_failure_listener(failures.append)
    params = SamplingParams(temperature=0.0, max_tokens=60)
    try:
        env.scheduler.hold_at(5)
        streams = [client.add_request(f"a{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(collect(stream)) for stream in streams]
        await wait_until_async(lambda: all(env.scheduler.progress(f"a{i}") >= 5 for i in range(3)))
        env.scheduler.crash()
        await asyncio.sleep(0.05)
        env.scheduler.release()
        env.scheduler.restart()
        await asyncio.to_thread(env.group.restart, SCHEDULER)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        for prompt, outputs in zip(PROMPTS, results, strict=True):
            assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected_tokens(prompt, 60)
        assert set(env.scheduler.resumed()) == {"a0", "a1", "a2"}

        # The group fails: every open stream ends with an error output, new requests are refused.
        env.scheduler.hold_at(2)  # no stream can finish first, however slow this machine
        streams = [client.add_request(f"b{i}", {"prompt_token_ids": p}, params.clone(max_tokens=200))
                   for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(collect(stream)) for stream in streams]
        # Wait until the client itself has taken in two tokens of each (the scheduler having sent
        # them is not enough: on a busy machine they may still be in the socket).
        await wait_until_async(lambda: all(stream._last is not None and len(stream._last.outputs[0].token_ids) >= 2
                                           for stream in streams))
        await asyncio.to_thread(env.group.fail, "restart budget spent")
        results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        for outputs in results:
            last = outputs[-1]
            assert last.finished and last.error == "restart budget spent"
            assert last.outputs[0].finish_reason == "error" and len(last.outputs[0].token_ids) >= 2
        assert failures == ["restart budget spent"] and client.num_unfinished == 0
        with pytest.raises(EngineDeadError, match="restart budget spent"):
            client.add_request("c", {"prompt_token_ids": [300]}, params)
        health = await client.health()
        assert health.status == "failed" and not health.serving
    finally:
        await client.shutdown()
    assert env.group.stopped


@pytest.mark.asyncio
async def test_attached_client_follows_the_supervisors_events_only(env: Env) -> None:
    bus = FakeBus(env.info.addresses.bus_out)
    client = AsyncEngineClient(env.info, env.tokenizer, load_tokenizer=False)  # attached: no group
    params = SamplingParams(temperature=0.0, max_tokens=60)
    try:
        client._ensure_tasks()
        view = client._supervision
        while "metrics" not in view.down:  # the subscription is live once an event comes through
            bus.publish(SUPERVISOR, [ActorFailed(actor="metrics", how="exited", detail="signal 9")])
            await asyncio.sleep(0.02)
        bus.publish(SUPERVISOR, [ActorRestarted(actor="metrics", pid=1, attempt=1, seconds=0.5)])
        await wait_until_async(lambda: "metrics" not in view.down)

        env.scheduler.hold_at(5)
        streams = [client.add_request(f"t{i}", {"prompt_token_ids": p}, params) for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(collect(stream)) for stream in streams]
        await wait_until_async(lambda: all(env.scheduler.progress(f"t{i}") >= 5 for i in range(3)))
        env.scheduler.crash()
        # Forgeries: supervisor events under another topic, or another actor under the supervisor's topic.
        bus.publish(SCHEDULER, [GroupFailed(reason="forged"), ActorRestarted(actor=SCHEDULER, pid=1, attempt=1,
                                                                            seconds=0.1)], actor=SUPERVISOR)
        bus.publish(SUPERVISOR, [GroupFailed(reason="forged")], actor="worker-0")
        bus.publish(SUPERVISOR, [ActorFailed(actor=SCHEDULER, how="exited", detail="signal 9")])
        await wait_until_async(lambda: SCHEDULER in view.down)
        assert client.failure is None and env.scheduler.resumed() == {}
        assert (await client.health(timeout=0.2)).unhealthy[SCHEDULER].startswith("restarting")
        env.scheduler.release()
        env.scheduler.restart()
        bus.publish(SUPERVISOR, [ActorRestarted(actor=SCHEDULER, pid=2, attempt=1, seconds=1.0)])
        results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        for prompt, outputs in zip(PROMPTS, results, strict=True):
            assert outputs[-1].outputs[0].token_ids == expected_tokens(prompt, 60)
        assert set(env.scheduler.resumed()) == {"t0", "t1", "t2"}

        env.scheduler.hold_at(2)
        stream = client.add_request("u", {"prompt_token_ids": [300]}, params.clone(max_tokens=200))
        task = asyncio.create_task(collect(stream))
        await wait_until_async(lambda: env.scheduler.progress("u") >= 2)
        bus.publish(SUPERVISOR, [GroupFailed(reason="worker-0 cannot start again")])
        last = (await asyncio.wait_for(task, 5))[-1]
        assert last.error == "worker-0 cannot start again" and last.outputs[0].finish_reason == "error"
        with pytest.raises(EngineDeadError, match="cannot start again"):
            client.add_request("v", {"prompt_token_ids": [300]}, params)
    finally:
        await client.shutdown()
        bus.close()

