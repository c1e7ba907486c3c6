"""KV parallelism through the process group on the CPU (gloo): each request's KV blocks spread over
the KV-parallel ranks, the attention merged by log-sum-exp every layer. KVP=2 on tiny Qwen3 (one KV
head) and KVP=3 on tiny Llama (six KV heads) give transformers' greedy tokens (float32) for prompts
of 3,000+ tokens beside short ones, with chunked prefill and preemption forced. A KV-parallel rank SIGKILLed while
a 2,000-token prompt decodes restarts alone: its peer keeps its PID, requests and KV, rejoins it,
and the two recompute only the dead rank's share of the computed positions (KV_SHARE_RECOVERED
counts them: fewer than the long prompt's); the outputs stay transformers'; no process outlives
the group."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TP_LLAMA_SHAPE, TP_QWEN3_SHAPE
from tests.process_group.test_pipeline_parallel import greedy, reference, short_prompts
from tests.process_group.test_tensor_parallel import _kill_when
from tests.support.lifecycle import settled_metrics
from tests.support.server_helpers import BusRecorder
from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM
from vllm_actors.protocol.events import KvShareRecovered
from vllm_actors.runtime.run_dir import pid_alive

ENGINE = dict(dtype="float32", device="cpu", block_size=16, seed=0, max_num_batched_tokens=512, max_model_len=3300)
LONG_TOKENS = 3000  # 188 blocks of 16: the pool below holds it and little beside it (preemption)


def _long(path: Path, kvp: int, blocks: int) -> LLM:
    return LLM(str(path), kv_parallel_size=kvp, num_gpu_blocks_override=blocks, **ENGINE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def qwen3_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kvp_qwen3"), "qwen3", tie_word_embeddings=True,
                            shape=TP_QWEN3_SHAPE | {"max_position_embeddings": 4096, "num_hidden_layers": 2})


@pytest.fixture(scope="module")
def llama_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("kvp_llama"), "llama", tie_word_embeddings=False,
                            shape=TP_LLAMA_SHAPE | {"max_position_embeddings": 4096, "num_hidden_layers": 2})


@pytest.fixture(scope="module")
def kvp2(qwen3_long: Path) -> Iterator[LLM]:
    """One KVP=2 group for the long prompts and the SIGKILL test (which ends it)."""
    with _long(qwen3_long, 2, 200) as llm:
        yield llm


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(LONG_TOKENS + 17)], *short_prompts(seed, count=5)]


def _check(llm: LLM, path: Path, prompts: list[list[int]]) -> None:
    got = greedy(llm, prompts)
    metrics = settled_metrics(llm, lambda m: m.requests_finished >= len(prompts) and m.kv_blocks_in_use == 0)
    assert metrics.preemptions > 0, "the KV pool was meant to force preemption"
    assert metrics.prefill_chunks >= LONG_TOKENS // 512, "the token budget was meant to split the long prompt"
    assert got == reference(path, prompts)


def test_kvp2_long_prompt_matches_transformers(kvp2: LLM, qwen3_long: Path) -> None:
    assert kvp2.group is not None
    assert kvp2.group.worker_info["attention"] == "torch+kv_parallel"
    assert kvp2.group.worker_info["num_blocks"] == 200  # both ranks' pools: 100 blocks each
    _check(kvp2, qwen3_long, _prompts(1))


def test_kvp3_on_llama_matches_transformers(llama_long: Path) -> None:
    with _long(llama_long, 3, 198) as llm:
        _check(llm, llama_long, _prompts(2))
        assert llm.group is not None
        workers = sorted(actor for actor in llm.group.pids() if actor.startswith("worker"))
    assert workers == ["worker-0", "worker-1", "worker-2"]


def test_sigkill_of_a_kv_parallel_rank_recomputes_only_its_share(kvp2: LLM, qwen3_long: Path) -> None:
    group = kvp2.group
    assert group is not None and group.worker_info["kv_rejoin"]
    recorder = BusRecorder(group.addresses.bus_out, group.addresses.bus_in)
    rng = random.Random(11)
    long = [rng.randrange(500) for _ in range(2000)]  # 4 chunks of 512
    prompts = [long, *short_prompts(11, count=3)]
    before = group.pids()
    generated = settled_metrics(kvp2, lambda m: True).generation_tokens
    killed = threading.Event()
    # 12 tokens out: the long prompt is prefilled (its chunks and the short prompts' first tokens
    # take 4 steps) and decoding; 64 tokens in all
    killer = threading.Thread(target=_kill_when, args=(kvp2, before["worker-1"], generated + 12, killed), daemon=True)
    killer.start()
    try:
        got = greedy(kvp2, prompts, max_tokens=16)
        killer.join(timeout=10)
        assert killed.is_set(), "worker-1 was not killed during the run"
        deadline = time.monotonic() + 30  # published at the rejoin, long before the outputs end: on the bus by now
        while not recorder.events("KV_SHARE_RECOVERED") and time.monotonic() < deadline:
            time.sleep(0.05)
        recovered = [event for event in recorder.events("KV_SHARE_RECOVERED") if isinstance(event, KvShareRecovered)]
    finally:
        recorder.close()
    after = group.pids()
    assert after["worker-0"] == before["worker-0"] and after["worker-1"] != before["worker-1"]
    assert group.restarts() == {"worker-1": 1}
    assert not recorder.events("PIPELINE_RESET")
    assert len(recovered) == 1 and recovered[0].rank == 1
    recomputed, computed = recovered[0].num_recomputed_tokens, recovered[0].num_computed_tokens
    print(f"\nKVP=2, rank 1 lost: {recomputed} of {computed} computed positions recomputed")
    assert computed > len(long) and 0 < recomputed < len(long)
    assert got == reference(qwen3_long, prompts, max_tokens=16)
    kvp2.shutdown()
    assert group.stopped
    assert not [pid for pid in set(before.values()) | set(after.values()) if pid_alive(pid)]
