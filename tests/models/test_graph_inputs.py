"""Decode graphs' packed inputs and the graphs that sample inside (runner/graph_inputs.py,
ModelRunner.execute_sampled, Sampler.graph_params).

CUDA graphs exist only on a GPU; here each "graph" is the same decode pass replayed eagerly over
the packed static inputs, so what is tested on the CPU is everything the host does: the packing
of one step into one buffer (padding, block tables, deferred ids) and the per-row sampling inputs,
against the unpadded eager pass and the sampler's own draw (Triton interpreted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_actors.actors.worker.step_data import BatchInput, DeferredInputs, SamplingRow
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.graph_inputs import GraphInputs
from vllm_actors.runner.model_runner import ModelRunner, _DecodeGraph
from vllm_actors.runner.sampler import Sampler

BLOCK = 4


class _EagerReplay:
    """Stands in for torch.cuda.CUDAGraph: replay() reruns the pass over the static inputs."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self._run = run
        self.output = run()

    def replay(self) -> None:
        self.output.copy_(self._run())


@pytest.fixture
def runner(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", device="cpu", block_size=BLOCK,
                          max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=32)
    runner = ModelRunner(config)
    runner._static = GraphInputs(4, runner.max_blocks_per_seq, BLOCK, runner.device)
    for size in (1, 2, 4):
        inputs = runner._static.for_bucket(size)
        meta = runner._static.meta(inputs, size, runner.max_model_len)
        for sampled, graphs in ((False, runner._graphs), (True, runner._sampled_graphs)):
            replay = _EagerReplay(lambda i=inputs, m=meta, s=sampled: runner._decode_pass(i, m, s))
            graphs[size] = _DecodeGraph(replay, replay.output)  # type: ignore[arg-type]
    runner._graph_sizes = [1, 2, 4]
    return runner


def _decode(tokens: list[int], positions: list[int], tables: list[list[int]]) -> BatchInput:
    return BatchInput(token_ids=list(tokens), positions=list(positions), query_lens=[1] * len(tokens),
                      seq_lens=[p + 1 for p in positions], block_tables=tables,
                      logits_indices=list(range(len(tokens))))


def _prefill(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> None:
    batch = BatchInput([], [], [], [], [], [])
    for prompt, table in zip(prompts, tables, strict=True):
        batch.token_ids.extend(prompt)
        batch.positions.extend(range(len(prompt)))
        batch.query_lens.append(len(prompt))
        batch.seq_lens.append(len(prompt))
        batch.block_tables.append(table)
        batch.logits_indices.append(len(batch.token_ids) - 1)
    runner._run_eager(batch)


def test_packed_decode_inputs_give_the_eager_logits(runner: ModelRunner) -> None:
    tables = [[0, 1, 2], [3, 4], [5, 6]]
    _prefill(runner, [[5, 9, 2, 7, 11, 3, 8], [4, 4, 6, 1, 2], [7]], tables)
    # three sequences padded to the bucket of 4; the second crosses into a new block
    step = _decode([12, 3, 9], [7, 5, 1], tables)
    expected = runner._run_eager(step)
    got = runner.execute(step)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # the padded row wrote nowhere and a one-row step after it sees the same cache
    one = _decode([6], [8], tables[:1])
    torch.testing.assert_close(runner.execute(one), runner._run_eager(one), atol=1e-5, rtol=1e-5)


def test_deferred_ids_travel_in_the_same_copy(runner: ModelRunner) -> None:
    tables = [[0, 1], [2, 3]]
    _prefill(runner, [[5, 9, 2], [4, 4, 6, 1]], tables)
    expected = runner._run_eager(_decode([12, 30], [3, 4], tables))
    step = _decode([0, 0], [3, 4], tables)
    step.deferred = DeferredInputs(flat_index=[0, 1], source=torch.tensor([30, 7, 12]), source_row=[2, 0])
    torch.testing.assert_close(runner.execute(step), expected, atol=1e-5, rtol=1e-5)


class _NoReplay:
    def replay(self) -> None:
        raise AssertionError("a step marked eager replayed a graph")


def test_a_step_marked_eager_replays_no_graph(runner: ModelRunner) -> None:
    """A step with a request on borrowed KV (``BatchInput.eager``): its attention calls out to other
    replicas, so neither graph runs it, whatever its shape."""
    tables = [[0, 1], [2, 3]]
    _prefill(runner, [[5, 9, 2], [4, 4, 6, 1]], tables)
    expected = runner._run_eager(_decode([12, 30], [3, 4], tables))
    step = _decode([12, 30], [3, 4], tables)
    step.eager = True
    assert not runner.samples_in_graph(step)
    for graphs in (runner._graphs, runner._sampled_graphs):
        for size, graph in graphs.items():
            graphs[size] = _DecodeGraph(_NoReplay(), graph.logits)  # type: ignore[arg-type]
    torch.testing.assert_close(runner.execute(step), expected, atol=1e-5, rtol=1e-5)
    step.eager = False  # the same step unmarked takes its graph
    with pytest.raises(AssertionError, match="replayed a graph"):
        runner.execute(step)


def _rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, num_output_tokens=3, min_tokens_stop_ids=[0]) for p in params]


def test_tokens_drawn_inside_the_graph_are_the_samplers_own(runner: ModelRunner) -> None:
    tables = [[0, 1], [2, 3], [4, 5]]
    _prefill(runner, [[5, 9, 2], [4, 4, 6, 1], [8, 8]], tables)
    step = _decode([12, 30, 7], [3, 4, 2], tables)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=11),
              SamplingParams(temperature=1.3)]
    assert runner.samples_in_graph(step)
    # the same sampler state drawn two ways: inside the "graph", and by draw() on the logits
    in_graph, reference = Sampler(runner.device, seed=5), Sampler(runner.device, seed=5)
    sampling = in_graph.graph_params(_rows(params))
    assert sampling is not None
    chosen = runner.execute_sampled(step, sampling).clone()
    logits = runner._run_eager(step)
    assert chosen.tolist() == reference.draw(logits, _rows(params)).tolist()
    assert chosen[0].item() == logits[0].argmax().item()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, presence_penalty=0.5),
    SamplingParams(temperature=1.0, min_tokens=8),
])
def test_rows_that_need_more_than_the_kernel_sample_outside(params: SamplingParams) -> None:
    sampler = Sampler(torch.device("cpu"))
    sampler.fused = True
    assert sampler.graph_params(_rows([SamplingParams(temperature=0.7), params])) is None
    assert sampler.graph_params(_rows([SamplingParams(temperature=0.7)])) is not None


def test_wide_tables_travel_compact_and_keep_the_graphs_rows() -> None:
    """A long max_model_len makes the graphs' table rows wide (20,000 blocks here): a bucket of short rows
    sends its used columns only and the device spreads them into the graph's table; a long row among them
    goes as well. What the graph reads (each row up to its length) is what the full copy gave."""
    from vllm_actors.actors.worker.block_tables import BlockTableArray

    width, cpu = 20_000, torch.device("cpu")
    static = GraphInputs(8, width, BLOCK, cpu)
    assert static._compact is not None
    array = BlockTableArray(width, capacity=8)
    rows = [array.add() for _ in range(3)]
    lengths = [2, 3, 12_000]
    for row, length in zip(rows, lengths, strict=True):
        array.append(row, [100 * (row + 1) + block % 50 for block in range(length)])

    def upload(count: int) -> torch.Tensor:
        positions = [length * BLOCK - 1 for length in lengths[:count]]
        batch = _decode([5] * count, positions, [list(array.table[row, :n]) for row, n in zip(rows, lengths)][:count])
        batch.table_rows = array.rows_of(rows[:count])
        static.upload(batch, 4, None)
        return static.device["block_tables"]

    tables = upload(2)  # two short rows: 3 columns travel
    assert tables[0, :2].tolist() == array.table[rows[0], :2].tolist()
    assert tables[1, :3].tolist() == array.table[rows[1], :3].tolist()
    assert tables[2:4, 0].tolist() == [0, 0]  # padded rows read block 0
    assert static.device["slot_mapping"][:2].tolist() == [int(array.table[rows[0], 1]) * BLOCK + BLOCK - 1,
                                                          int(array.table[rows[1], 2]) * BLOCK + BLOCK - 1]
    tables = upload(3)  # with the long row
    for row, length in zip(rows, lengths, strict=True):
        assert tables[row, :length].tolist() == array.table[row, :length].tolist()
    assert tables[3, 0].item() == 0
