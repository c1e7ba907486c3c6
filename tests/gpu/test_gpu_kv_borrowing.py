"""On two GPUs: borrowed KV capacity across the replicas of a set (``kv_borrowing``, DP=2, one GPU
per replica, their workers' gloo group staged through pinned host memory). A 2,500-token request
whose KV does not fit one replica's pool of 120 blocks runs on its home with blocks lent by the
other replica, prefilled in chunks of 512 and decoded beside short requests on both replicas: the
home's steps with the guest run eagerly, the others replay their CUDA graphs (the default), the
fused K/V write skips the guest's tokens in lent blocks, the lender answers on a CUDA stream of its
own thread. Greedy tokens equal one replica's with a pool big enough for it, in float32, logprobs
within 1e-3; the lender lends once and gets its blocks back. On four GPUs (DP=4, pools of 64) a
3,000-token request borrows from all three other replicas, asked at once at every layer.

Skipped without two CUDA devices (the DP=4 test without four); run on nvidia-h200-x2 by
``pytest -m gpu tests/gpu/test_gpu_kv_borrowing.py``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import TP_QWEN3_SHAPE
from tests.gpu.test_gpu_pipeline_parallel import pytestmark  # noqa: F401 (2 GPUs, marked gpu)
from tests.process_group.test_kv_borrowing_set import all_events
from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.events import KvLent, KvReturned, Routed

BLOCK, MAX_TOKENS = 16, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("gpu_borrow"), "qwen3", tie_word_embeddings=True,
                            shape=TP_QWEN3_SHAPE | {"max_position_embeddings": 4096, "num_hidden_layers": 2})


def _prompts(long: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(500) for _ in range(n)] for n in (long, 40, 90, 70, 30, 300, 12)]


def _generate(path: Path, prompts: list[list[int]], **engine: Any) -> tuple[list[list[int]], list[list[float]],
                                                                                 list[tuple[str, Any]]]:
    """Greedy tokens, their logprobs and every event of the run (the set's loans among them)."""
    with LLM(str(path), dtype="float32", seed=0, block_size=BLOCK, max_num_batched_tokens=512, max_model_len=4096,
             **engine) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        scored = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        events = all_events(llm.engine.query_metrics)
        deadline = time.monotonic() + 60  # a loan's return follows the finish
        while engine.get("kv_borrowing") and not any(isinstance(e, KvReturned) for _, e in events) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            events = all_events(llm.engine.query_metrics)
    logprobs = [[entry[token].logprob for entry, token in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids,
                                                               strict=True)] for o in scored]
    return [list(o.outputs[0].token_ids) for o in scored], logprobs, events


def _same(got: tuple[list[list[int]], list[list[float]], Any], want: tuple[list[list[int]], list[list[float]], Any]
          ) -> None:
    assert got[0] == want[0]
    for ours, theirs in zip(got[1], want[1], strict=True):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


def _loans(events: list[tuple[str, Any]]) -> tuple[int, list[str], list[str]]:
    """The borrowed request's home, the lenders' managers that lent and that got their blocks back."""
    routed = [event for _, event in events if isinstance(event, Routed) and event.reason == "borrowed"]
    assert len(routed) == 1, "the long request was meant to borrow"
    lent = [actor for actor, event in events if isinstance(event, KvLent) and event.request_id == routed[0].request_id]
    returned = [actor for actor, event in events if isinstance(event, KvReturned)]
    return routed[0].replica, lent, returned


def test_dp2_borrowing_on_gpus_gives_one_replicas_tokens(checkpoint: Path) -> None:
    prompts = _prompts(2500)  # 158 blocks with its outputs: more than a pool, less than the two shares (108 each)
    borrowed = _generate(checkpoint, prompts, data_parallel_size=2, kv_borrowing=True, num_gpu_blocks_override=120)
    home, lent, returned = _loans(borrowed[2])
    assert lent == [f"kv_cache_manager@{1 - home}"] and returned == lent
    _same(borrowed, _generate(checkpoint, prompts, num_gpu_blocks_override=400))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_dp4_borrowing_from_three_lenders_gives_one_replicas_tokens(checkpoint: Path) -> None:
    prompts = _prompts(3000)  # 189 blocks: the home's share of a pool of 64 (57) and all three others'
    borrowed = _generate(checkpoint, prompts, data_parallel_size=4, kv_borrowing=True, num_gpu_blocks_override=64)
    home, lent, returned = _loans(borrowed[2])
    assert sorted(lent) == sorted(f"kv_cache_manager@{r}" for r in range(4) if r != home)
    assert sorted(returned) == sorted(lent)
    _same(borrowed, _generate(checkpoint, prompts, num_gpu_blocks_override=400))
