"""Recovery on the client side, in the sync client and ``LLM``: after a scheduler restart the client
sends its unfinished requests again (resume=True, with the tokens received so far); when the group
fails every open request ends at once with finish reason "error" and new ones are refused.

Covered without processes (the frontend state machine alone is in state_machines/test_frontend_resubmit.py;
the asyncio client in test_async_client_recovery.py, the HTTP server in test_http_recovery.py). A fake
scheduler on a real ROUTER socket stands in for the scheduler process (its "crash" loses every
request and what arrives while it is down); a fake process group stands in for the supervisor,
calling its listeners from a thread of its own as the monitor thread does.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest

from tests.support.fake_env import PROMPTS
from tests.support.fake_scheduler import Env, FakeGroup, expected_tokens, wait_until
from vllm_actors import SamplingParams
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.core import EngineDeadError
from vllm_actors.clients.sync_client import EngineClient
from vllm_actors.llm import LLM
from vllm_actors.protocol.names import SCHEDULER


def test_sync_client_resubmits_after_a_scheduler_restart(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    params = SamplingParams(temperature=0.0, max_tokens=60)
    env.scheduler.hold_at(5)
    try:
        for i, prompt in enumerate(PROMPTS):
            client.submit(client.prepare(f"s{i}", {"prompt_token_ids": prompt}, params))
        finals: dict[str, RequestOutput] = {}
        received: dict[str, int] = {}

        def collect() -> None:
            for output in client.poll(10):
                received[output.request_id] = len(output.outputs[0].token_ids)
                if output.finished:
                    finals[output.request_id] = output

        def collected(condition: Callable[[], bool]) -> Callable[[], bool]:
            def check() -> bool:
                collect()
                return condition()
            return check

        wait_until(collected(lambda: all(received.get(f"s{i}", 0) >= 5 for i in range(3))))
        env.scheduler.crash()
        client.submit(client.prepare("late", {"prompt_token_ids": [340]}, params))  # lost: nobody listens
        env.group.restart("kv_cache_manager")  # another actor: nothing for the clients to do
        collect()
        assert env.scheduler.resumed() == {}
        env.scheduler.release()
        env.scheduler.restart()
        env.group.restart(SCHEDULER)  # READY again: the listener fires on the supervisor's thread
        wait_until(collected(lambda: len(finals) == 4))
        resumed = env.scheduler.resumed()
        assert set(resumed) == {"s0", "s1", "s2", "late"} and resumed["late"] == []
        for i, prompt in enumerate(PROMPTS):
            ids = finals[f"s{i}"].outputs[0].token_ids
            assert ids == expected_tokens(prompt, 60), "a token lost or counted twice"
            assert len(resumed[f"s{i}"]) >= 5 and resumed[f"s{i}"] == ids[: len(resumed[f"s{i}"])]
            assert finals[f"s{i}"].outputs[0].text == env.tokenizer.decode(ids)
        assert finals["late"].outputs[0].token_ids == expected_tokens([340], 60)
    finally:
        client.close()


def offline_llm(client: EngineClient, group: FakeGroup) -> LLM:
    """An LLM over a client of the fake group (its constructor would start real processes)."""
    llm = LLM.__new__(LLM)
    llm._client, llm._group, llm._ids = client, group, itertools.count()  # type: ignore[assignment]
    return llm


def in_background(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def test_llm_generate_returns_complete_outputs_across_a_scheduler_restart(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    llm = offline_llm(client, env.group)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    env.scheduler.hold_at(5)

    def chaos() -> None:
        wait_until(lambda: all(env.scheduler.progress(str(i)) >= 5 for i in range(3)))
        env.scheduler.crash()
        time.sleep(0.1)
        env.scheduler.release()
        env.scheduler.restart()
        env.group.restart(SCHEDULER)

    try:
        thread = in_background(chaos)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=80), use_tqdm=False)
        thread.join()
        assert [o.outputs[0].token_ids for o in outputs] == [expected_tokens(p, 80) for p in PROMPTS]
        assert all(o.finished and o.error is None and o.outputs[0].finish_reason == "length" for o in outputs)
        assert set(env.scheduler.resumed()) == {"0", "1", "2"}
    finally:
        client.close()


def test_llm_raises_the_groups_failure_at_once(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    llm = offline_llm(client, env.group)

    env.scheduler.hold_at(3)

    def chaos() -> None:
        wait_until(lambda: env.scheduler.progress("0") >= 3)
        env.scheduler.crash()
        env.group.fail("actor scheduler: 6 restarts within 60 s")

    try:
        thread = in_background(chaos)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="6 restarts within 60 s"):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=200),
                         use_tqdm=False)
        thread.join()
        assert time.monotonic() - start < 5
        assert not client.has_unfinished
        with pytest.raises(EngineDeadError, match="6 restarts within 60 s"):
            llm.generate({"prompt_token_ids": [300]}, use_tqdm=False)
    finally:
        client.close()


def test_sync_client_failure_ends_open_requests_with_an_error(env: Env) -> None:
    client = EngineClient(env.info, env.tokenizer, group=env.group)
    try:
        env.scheduler.hold_at(2)
        client.submit(client.prepare("f", {"prompt_token_ids": [300]}, SamplingParams(max_tokens=200)))
        wait_until(lambda: bool(client.poll(5)) and env.scheduler.progress("f") >= 2)
        env.group.fail("the model no longer loads")
        (final,) = client.poll(0)
        assert final.finished and final.error == "the model no longer loads"
        assert final.outputs[0].finish_reason == "error" and final.outputs[0].token_ids
        assert client.failure == "the model no longer loads" and client.poll(0) == []
        with pytest.raises(EngineDeadError, match="no longer loads"):
            client.submit(client.prepare("g", {"prompt_token_ids": [300]}, SamplingParams(max_tokens=2)))
    finally:
        client.close()

