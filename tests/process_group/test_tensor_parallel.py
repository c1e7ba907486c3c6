"""Tensor parallelism through the process group on the CPU (gloo): TP=2 and TP=3 give TP=1's
greedy tokens and logprobs (float32) under preemption, chunked prefill, deferred steps and prefix
caching; a draft model's speculative decoding at TP=2 (the draft whole on each rank, rank 0's drafts
kept) gives the tokens of TP=1 without it; a SIGKILLed rank takes its unit down, which comes back and
finishes the requests; no process outlives the group."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.lifecycle import settled_metrics
from vllm_actors import LLM, SamplingParams
from vllm_actors.clients.supervision import classify
from vllm_actors.runtime.run_dir import pid_alive
from vllm_actors.runtime.supervisor import ProcessGroup

MAX_TOKENS = 12
NUM_BLOCKS = 16  # 256 tokens for 10 prompts of up to 120: preemption
ENGINE = dict(dtype="float32", device="cpu", block_size=16, num_gpu_blocks_override=NUM_BLOCKS,
              max_num_batched_tokens=32, max_model_len=256, seed=0)


def prompts_for(vocab_size: int, seed: int) -> list[list[int]]:
    """10 prompts of 3-120 tokens, the last four sharing a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab_size) for _ in range(40)]
    own = [[rng.randrange(vocab_size) for _ in range(n)] for n in (3, 17, 33, 60, 90, 120)]
    return own + [shared + [rng.randrange(vocab_size) for _ in range(n)] for n in (1, 9, 20, 30)]


def _run(path: Path, tp_size: int, prompts: list[list[int]]) -> dict[str, Any]:
    """TP=1 (the reference) runs in this process: one engine, no group to start."""
    executor = "inprocess" if tp_size == 1 else "group"
    with LLM(str(path), executor=executor, tensor_parallel_size=tp_size, **ENGINE) as llm:  # type: ignore[arg-type]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        # logprobs: every step is read back before the next; without: deferred (overlapped) steps
        with_logprobs = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1,
                                                            ignore_eos=True), use_tqdm=False)
        deferred = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                use_tqdm=False)
        metrics = settled_metrics(llm, lambda m: m.requests_finished == 2 * len(prompts) and m.kv_blocks_in_use == 0)
        workers = {actor: pid for actor, pid in (llm.group.pids() if llm.group else {}).items()
                   if actor.startswith("worker")}
    return {
        "tokens": [o.outputs[0].token_ids for o in with_logprobs],
        "logprobs": [[entry[token].logprob for entry, token in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids,
                                                                     strict=True)] for o in with_logprobs],
        "deferred": [o.outputs[0].token_ids for o in deferred],
        "metrics": metrics,
        "workers": workers,
    }


_reference: dict[str, dict[str, Any]] = {}


@pytest.mark.parametrize("tp_size", [2, 3])
@pytest.mark.parametrize("checkpoint", ["tiny_qwen3_tp", "tiny_llama_tp"])
def test_tp_greedy_and_logprobs_match_tp1(checkpoint: str, tp_size: int, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    prompts = prompts_for(500, seed={"tiny_qwen3_tp": 3, "tiny_llama_tp": 4}[checkpoint])
    if checkpoint not in _reference:
        _reference[checkpoint] = _run(path, 1, prompts)
    want, got = _reference[checkpoint], _run(path, tp_size, prompts)
    assert sorted(got["workers"]) == [f"worker-{rank}" for rank in range(tp_size)]
    metrics = got["metrics"]
    assert metrics.preemptions > 0, "the KV pool was meant to force preemption"
    assert metrics.prefill_chunks > 2 * len(prompts), "the token budget was meant to force chunking"
    assert metrics.prefix_cache_hits > 0, "the shared prefix was meant to hit the prefix cache"
    assert got["tokens"] == want["tokens"]
    assert got["deferred"] == want["deferred"] == want["tokens"]
    for ours, theirs in zip(got["logprobs"], want["logprobs"], strict=True):
        assert len(ours) == len(theirs) == MAX_TOKENS
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4


def test_a_draft_model_at_tp2_gives_the_tokens_of_tp1_without_speculation(tiny_qwen3_tp: Path) -> None:
    """The target as its own draft (drafts mostly right), greedy rows and penalised ones."""
    from vllm_actors.protocol.speculative import parse_speculative_config

    prompts = prompts_for(500, seed=5)[:6]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             **({"presence_penalty": 0.8} if index % 2 else {})) for index in range(len(prompts))]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(str(tiny_qwen3_tp), executor="inprocess", **ENGINE) as llm:  # type: ignore[arg-type]
        expected = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    spec = parse_speculative_config({"method": "draft_model", "model": str(tiny_qwen3_tp), "num_speculative_tokens": 3},
                                    adaptive=False)
    engine = {**ENGINE, "num_gpu_blocks_override": 4 * NUM_BLOCKS}
    with LLM(str(tiny_qwen3_tp), executor="group", tensor_parallel_size=2, speculative_config=spec,
             **engine) as llm:  # type: ignore[arg-type]
        got = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
        counts = llm.get_metrics().spec_decode
    assert got == expected
    assert 0 < counts.num_accepted_tokens <= counts.num_draft_tokens


def _kill_when(llm: LLM, pid: int, tokens: int, killed: threading.Event) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if llm.get_metrics().generation_tokens > tokens:
            os.kill(pid, signal.SIGKILL)
            killed.set()
            return
        time.sleep(0.02)


def test_sigkill_of_one_rank_restarts_the_unit_and_loses_nothing(tiny_qwen3_tp: Path) -> None:
    prompts = prompts_for(500, seed=7)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    with LLM(str(tiny_qwen3_tp), executor="inprocess", **ENGINE) as llm:  # type: ignore[arg-type]
        reference = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    with LLM(str(tiny_qwen3_tp), tensor_parallel_size=2, **ENGINE) as llm:  # type: ignore[arg-type]
        group = llm.group
        assert group is not None
        before = group.pids()
        health_at_restart: list[Any] = []
        spawn = group._spawn

        def spawn_and_look(spec: Any) -> Any:  # the supervisor's view while the unit restarts
            if spec.role == "worker" and spec.incarnation > 0:
                health_at_restart.append(classify(group.state()))
            return spawn(spec)

        group._spawn = spawn_and_look  # type: ignore[method-assign]
        how_failed: dict[str, str] = {}
        with_unit = group._with_unit

        def with_unit_and_look(failures: Any) -> Any:  # how each rank went down, as the supervisor saw it
            unit = with_unit(failures)
            how_failed.update({child.actor_id: how for child, how, _ in unit})
            return unit

        group._with_unit = with_unit_and_look  # type: ignore[method-assign]
        killed = threading.Event()
        killer = threading.Thread(target=_kill_when, args=(llm, before["worker-1"], 40, killed), daemon=True)
        killer.start()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        killer.join(timeout=10)
        assert killed.is_set(), "the rank was not killed during the run"
        after = group.pids()
        assert after["worker-0"] != before["worker-0"] and after["worker-1"] != before["worker-1"]
        assert group.restarts() == {"worker-0": 1, "worker-1": 1}
        health = health_at_restart[0]
        assert health.status == "unavailable"
        assert how_failed["worker-1"] == "exited" and health.unhealthy["worker-1"] == "restarting"
        if how_failed["worker-0"] == "unit":  # still up when the supervisor looked: /health names the rank down
            assert health.unhealthy["worker-0"] == "restarting (worker-1 is down)"
        else:  # its collective had lost the peer and it had exited too (CI saw it once): restarting on its own count
            assert how_failed["worker-0"] == "exited" and health.unhealthy["worker-0"] == "restarting"
        every_pid = set(before.values()) | set(after.values())
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert group.stopped
    assert not [pid for pid in every_pid if pid_alive(pid)]


def test_a_rank_killed_with_no_restart_left_fails_the_group_and_leaves_no_process(tiny_qwen3_tp: Path) -> None:
    from vllm_actors.protocol.config import EngineConfig

    config = EngineConfig(model=str(tiny_qwen3_tp), tensor_parallel_size=3, **ENGINE)  # type: ignore[arg-type]
    group = ProcessGroup(config, max_restarts=0)
    try:
        group.start()
        pids = group.pids()
        os.kill(pids["worker-2"], signal.SIGKILL)
        assert group.wait_stopped(timeout=120)
        assert group.failed is not None and "worker-2" in group.failed
        assert not [pid for pid in pids.values() if pid_alive(pid)]
    finally:
        group.shutdown()
