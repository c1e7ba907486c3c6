"""On a GPU: a verification step (every token a logits row, 1 to 8 per sequence) replays a captured
decode graph as one decode row per token (runner/verify_rows.py), and its logits are the eager
varlen pass's; a speculating runner's graphs read the rows' query groups (one KV read for several
rows of a sequence), so many drafting requests take the rows. Skipped without CUDA; run on the GPU
machine by benchmarks/gpu_session.sh (pytest stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.test_verify_rows import _batch
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.speculative import parse_speculative_config
from vllm_actors.runner import verify_rows
from vllm_actors.runner.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def recording_replays(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[tuple[BatchInput, int]]:
    """The (batch, bucket) of each graph replay of ``runner`` from now on."""
    replayed: list[tuple[BatchInput, int]] = []
    run_graph = runner._run_graph

    def recorded(batch: BatchInput, bucket: int, sampling: object = None) -> torch.Tensor:
        replayed.append((batch, bucket))
        return run_graph(batch, bucket)

    monkeypatch.setattr(runner, "_run_graph", recorded)
    return replayed


def test_verification_step_replays_a_decode_graph(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", device="cuda", block_size=16,
                          max_num_batched_tokens=256, max_num_seqs=16, max_model_len=256, num_gpu_blocks_override=64)
    # The tiny model's weights are so small that the cost rule would refuse these rows (181 KB of extra KV
    # reads against 25% of 573 KB): this test is of the graph path, the rule has its own test on the CPU.
    monkeypatch.setattr(verify_rows, "KV_SHARE", 100.0)
    runner = ModelRunner(config)
    assert runner._graphs
    tables = [[0, 1], [2, 3], [4, 5]]
    prompts = [list(range(3, 23)), [7] * 5, list(range(40, 57))]
    runner.execute(_batch(prompts, [0] * 3, tables, every_row=False))
    step = _batch([[1, 2, 3, 4, 5, 6, 7, 8], [9], [10, 11, 12]], [len(p) for p in prompts], tables, every_row=True)
    replayed = recording_replays(runner, monkeypatch)
    logits = runner.execute(step).float().clone()
    assert [bucket for _, bucket in replayed] == [16]  # 12 rows: the bucket of 16
    torch.testing.assert_close(logits, runner._run_eager(step).float(), atol=1e-3, rtol=1e-3)


def test_a_speculating_runner_replays_many_drafting_requests_as_query_groups(
        tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With speculation configured the graphs read the rows' query groups: 8 sequences of 1 to 8 tokens
    (8 rows a KV read for the tiny model's 4 heads over 2) take the decode rows under the real cost
    rule, one graph replay, and give the eager varlen pass's logits."""
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3})
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", device="cuda", block_size=16,
                          max_num_batched_tokens=256, max_num_seqs=60, max_model_len=256, num_gpu_blocks_override=64,
                          speculative_config=spec)
    runner = ModelRunner(config)
    assert runner._static is not None and runner._static.queries_per_read == 8
    # graphs for every sequence's verification rows (60 x 8 within the budget of 256), sampling ones for decodes
    assert max(runner._graphs) == 256 and 60 in runner._graphs and max(runner._sampled_graphs) == 60
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(8)]
    prompts = [[(7 * i + j) % 500 for j in range(10 + 3 * i)] for i in range(8)]
    runner.execute(_batch(prompts, [0] * 8, tables, every_row=False))
    drafts = [[(i + j) % 500 for j in range(1 + i)] for i in range(8)]  # 1 to 8 tokens
    step = _batch(drafts, [len(p) for p in prompts], tables, every_row=True)
    assert verify_rows.extra_kv_bytes(step, runner.bytes_per_block / runner.block_size) \
        > verify_rows.KV_SHARE * runner._weight_bytes  # one KV read a row would be refused
    replayed = recording_replays(runner, monkeypatch)
    logits = runner.execute(step).float().clone()
    assert [batch.row_groups for batch, _ in replayed] == [list(range(1, 9))]
    torch.testing.assert_close(logits, runner._run_eager(step).float(), atol=1e-3, rtol=1e-3)
