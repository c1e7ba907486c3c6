"""Scheduling fields end to end: ``LLM.generate(priority=...)`` orders admission under
the "priority" policy; through the HTTP server ``priority`` and the latency targets reach the
scheduler (the ARRIVED and QUEUED events carry them) and ``--reject-unmeetable`` answers 503."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from vllm_actors import LLM, SamplingParams
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.server import build_app
from vllm_actors.server.serving import ServerOptions
from vllm_actors.server.targets import Targets, parse_default_targets


def scheduled_steps(llm: LLM, request_ids: list[str]) -> list[int]:
    steps = []
    for request_id in request_ids:
        entries = [e for e in llm.get_timeline(request_id).events if e.type == "SCHEDULED"]
        steps.append(entries[0].event.step_id)  # type: ignore[attr-defined]
    return steps


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_llm_generate_priority_orders_admission(tiny_qwen3: Path, policy: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", max_num_seqs=1, max_model_len=128,
             num_gpu_blocks_override=64, scheduling_policy=policy) as llm:
        outputs = llm.generate(["a b", "c d", "e f", "g h"], params, use_tqdm=False, priority=[5, 3, 0, 1])
        steps = scheduled_steps(llm, [o.request_id for o in outputs])
    order = [index for _, index in sorted(zip(steps, range(4), strict=True))]
    # The first one takes the only slot on arrival; then by priority, or in arrival order.
    assert order == ([0, 2, 3, 1] if policy == "priority" else [0, 1, 2, 3])


@pytest.mark.parametrize("policy", ["edf", "lrs"])
def test_slot_preemption_under_deadline_policies_keeps_every_output_exact(tiny_qwen3: Path, policy: str) -> None:
    """Two sequence slots, six requests whose deadlines come earlier the later they arrive: the
    deadline policies preempt running requests for the slots (recomputing them later), and every
    output is still the greedy one of an FCFS run."""
    prompts = ["a b", "c d e", "f g", "h i j k", "l m", "n o p"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = {"executor": "inprocess", "dtype": "float32", "max_num_seqs": 2, "max_model_len": 128,
              "num_gpu_blocks_override": 64}
    with LLM(str(tiny_qwen3), scheduling_policy="fcfs", **kwargs) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(tiny_qwen3), scheduling_policy=policy, **kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False,
                               e2e_target_ms=[600_000.0 - 100_000.0 * index for index in range(len(prompts))])
        preempted = [e for o in outputs for e in llm.get_timeline(o.request_id).events if e.type == "PREEMPTED"]
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert preempted, "no request was preempted for a slot: the test did not exercise it"


def test_llm_generate_rejects_an_unmeetable_target(tiny_qwen3: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", max_model_len=128,
             num_gpu_blocks_override=64, scheduling_policy="edf", reject_unmeetable=True) as llm:
        # The cost model's prior (nothing measured yet): 50 tokens take far more than a microsecond.
        with pytest.raises(ValueError, match="unmeetable deadline"):
            llm.generate("a b", params, use_tqdm=False, e2e_target_ms=0.001)
        assert llm.generate("a b", params, use_tqdm=False, e2e_target_ms=600_000)[0].outputs[0].token_ids


def test_default_targets_flag_parses_per_endpoint() -> None:
    assert parse_default_targets(["chat:ttft=200,e2e=5000", "completions:e2e=100"]) == {
        "chat": Targets(200.0, 5000.0), "completions": Targets(None, 100.0)}
    with pytest.raises(ValueError):
        parse_default_targets(["embeddings:ttft=1"])


@pytest.mark.asyncio
async def test_http_priority_and_targets_reach_the_scheduler_and_unmeetable_is_503(tiny_qwen3: Path) -> None:
    client = await AsyncEngineClient.start(str(tiny_qwen3), dtype="float32", max_model_len=256,
                                           num_gpu_blocks_override=256, scheduling_policy="priority",
                                           reject_unmeetable=True)
    try:
        options = ServerOptions(endpoint_targets={"chat": Targets(ttft_ms=0.001)})
        app = build_app(client, options=options)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app",
                                     timeout=120) as http:
            # First request: the cost model holds its prior only, so the prediction is deterministic.
            body = {"prompt": "Hi", "max_tokens": 50, "ignore_eos": True, "e2e_target_ms": 0.001}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["message"].startswith("unmeetable deadline")
            # The chat endpoint's default TTFT target applies when the body sets none.
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            response = await http.post("/v1/chat/completions", json=chat)
            assert response.status_code == 503, response.text
            # The server keeps serving; priority and the targets are honoured, not refused.
            body = {"prompt": "Hi", "max_tokens": 2, "priority": 3, "ttft_target_ms": 600_000,
                    "e2e_target_ms": 900_000, "request_id": "prio"}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert (await http.post("/v1/completions", json={**body, "ttft_target_ms": -1})).status_code == 400
        engine_id = response.json()["id"] + "-0"
        timeline = await client.get_timeline(engine_id)
        events = {entry.type: entry.event for entry in timeline.events}
        for kind in ("ARRIVED", "QUEUED"):
            event = events[kind]
            assert event.priority == 3  # type: ignore[attr-defined]
            assert event.e2e_deadline - event.ttft_deadline == pytest.approx(300.0)  # type: ignore[attr-defined]
    finally:
        await client.shutdown()


def test_serve_flags_reach_the_engine_and_the_server() -> None:
    from vllm_actors.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "some/model", "--scheduling-policy", "lrs", "--reject-unmeetable",
                                      "--default-ttft-target-ms", "250", "--default-targets", "chat:e2e=5000"])
    kwargs = engine_kwargs(args)
    assert (kwargs["scheduling_policy"], kwargs["reject_unmeetable"]) == ("lrs", True)
    assert (args.default_ttft_target_ms, args.default_e2e_target_ms, args.default_targets) == (
        250.0, None, ["chat:e2e=5000"])
