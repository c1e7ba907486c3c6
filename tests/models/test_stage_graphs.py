"""A pipeline stage's decode graphs (runner/stage_graphs.py): the hand-over stays outside the
graph. CUDA graphs exist only on a GPU; here, as in test_graph_inputs.py, each "graph" is the
captured pass replayed eagerly over the static inputs, and the two stages of a tiny Qwen3 run in
one process, handing over through a list instead of torch.distributed. What is tested is what
the host does around the replay: a later stage's received rows copied into its bucket's static
input, an earlier stage's output rows copied before they are sent; the logits against the stages'
eager passes (which the process tests hold to transformers')."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.test_graph_inputs import BLOCK, _decode, _EagerReplay
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.models.pipeline import PipelineStage
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runner.graph_inputs import GraphInputs
from vllm_actors.runner.model_runner import ModelRunner, _DecodeGraph
from vllm_actors.runner.stage_graphs import StageGraphIO


@dataclass(frozen=True)
class _LocalStage(PipelineStage):
    """A stage whose hand-over is a list shared with its neighbour (one process, no group)."""

    channel: list[torch.Tensor] = field(default_factory=list, compare=False)

    def send(self, hidden: torch.Tensor) -> None:
        self.channel.append(hidden)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        received = self.channel.pop(0)
        assert received.shape == (2, num_tokens, hidden_size)
        return received

    def min_int(self, value: int, device: torch.device) -> int:
        return value


def _config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=BLOCK, max_num_batched_tokens=64,
                        max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=32)


def _with_graphs(runner: ModelRunner, stage: PipelineStage | None) -> ModelRunner:
    """Decode "graphs" of buckets 2 and 4 built as the capture builds them."""
    runner._static = GraphInputs(4, runner.max_blocks_per_seq, BLOCK, runner.device)
    if stage is not None:
        runner._stage_io = StageGraphIO(stage, 4, runner.local_config.hidden_size, runner.dtype, runner.device)
    for size in (2, 4):
        inputs: dict[str, Any] = runner._static.for_bucket(size)
        if stage is not None:
            inputs = runner._stage_io.bucket_inputs(inputs, size)
        meta = runner._static.meta(inputs, size, runner.max_model_len)
        replay = _EagerReplay(lambda i=inputs, m=meta: runner._decode_pass(i, m, False))
        runner._graphs[size] = _DecodeGraph(replay, replay.output)  # type: ignore[arg-type]
    runner._graph_sizes = [2, 4]
    return runner


@pytest.fixture
def stages(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ModelRunner, ModelRunner]:
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    channel: list[torch.Tensor] = []
    first = _LocalStage(stage=0, size=2, start=0, end=2, channel=channel)
    last = _LocalStage(stage=1, size=2, start=2, end=3, channel=channel)
    return (_with_graphs(ModelRunner(_config(tiny_qwen3), stage=first), first),
            _with_graphs(ModelRunner(_config(tiny_qwen3), stage=last), last))


def _both(first: ModelRunner, last: ModelRunner, batch: BatchInput, graphs: bool = True) -> torch.Tensor:
    if graphs:
        assert first.execute(batch).numel() == 0  # its output went on
        return last.execute(batch)
    first._run_eager(batch)
    return last._run_eager(batch)


def test_stage_graphs_hand_over_around_the_replay(stages: tuple[ModelRunner, ModelRunner]) -> None:
    first, last = stages
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    prompts = [[5, 9, 2, 7, 11, 3, 8], [4, 4, 6, 1, 2], [7]]
    prefill = BatchInput([t for p in prompts for t in p], [i for p in prompts for i in range(len(p))],
                         [len(p) for p in prompts], [len(p) for p in prompts], tables, [6, 11, 12])
    assert _both(first, last, prefill, graphs=False).shape == (3, 512)
    # three rows in the bucket of 4 on both stages; then one row in the bucket of 2, which reads
    # the KV the graphs wrote and its rows of the same static input (the padded row: stale values)
    for step in (_decode([12, 3, 9], [7, 5, 1], tables), _decode([6], [8], tables[:1])):
        expected = _both(first, last, step, graphs=False)  # writes the same KV as the graphs do next
        got = _both(first, last, step)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # what the first stage sends is a copy of its graph's output rows (the next replay overwrites it)
    assert first.execute(_decode([2, 5], [9, 6], tables[:2])).numel() == 0
    stage = first.stage
    assert isinstance(stage, _LocalStage)
    sent, output = stage.channel.pop(), first._graphs[2].logits
    assert sent.shape == (2, 2, first.local_config.hidden_size) and sent.data_ptr() != output.data_ptr()
    torch.testing.assert_close(sent, output[:, :2])
