"""On a GPU: a verification step (every token a logits row, 1 to 8 per sequence) replays a captured
decode graph as one decode row per token (runner/verify_rows.py), and its logits are the eager
varlen pass's. Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh (pytest stage)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.test_verify_rows import _batch
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runner import verify_rows
from vllm_actors.runner.model_runner import ModelRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


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
    replayed: list[int] = []
    run_graph = runner._run_graph

    def recorded(batch: BatchInput, bucket: int, sampling: object = None) -> torch.Tensor:
        replayed.append(bucket)
        return run_graph(batch, bucket)

    monkeypatch.setattr(runner, "_run_graph", recorded)
    logits = runner.execute(step).float().clone()
    assert replayed == [16]  # 12 rows: the bucket of 16
    torch.testing.assert_close(logits, runner._run_eager(step).float(), atol=1e-3, rtol=1e-3)
