"""On a GPU: a verification step's tokens drawn inside the captured decode graph (runner/graph_draws.py)
are the eager sampler's over the same graph's logits, row for row (greedy, seeded and unseeded rows,
each keyed by its own output index); and a speculating engine whose verification steps all draw in
the graph gives the tokens of the same engine with the graph sampler off and of no speculation,
greedy and seeded. Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.test_verify_rows import _batch
from tests.support.inprocess_runs import output_token_ids
from vllm_actors.actors.worker.step_data import BatchInput, GraphSampling, SamplingRow
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import SpeculativeConfig, parse_speculative_config
from vllm_actors.runner import verify_rows
from vllm_actors.runner.model_runner import ModelRunner
from vllm_actors.runner.sampler import Sampler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[(i * 13 + j * 7) % 500 for j in range(8 + 3 * i)] for i in range(4)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=7, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=1.3, seed=11, max_tokens=16, ignore_eos=True)]


def _config(model: Path, spec: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(model=str(model), dtype="float32", device="cuda", block_size=16, max_num_batched_tokens=256,
                        max_num_seqs=16, max_model_len=256, num_gpu_blocks_override=64, speculative_config=spec)


def _rows(params: list[SamplingParams], drafts: list[list[int]], outputs: int) -> list[SamplingRow]:
    """The verification rows of ``expand_rows``: a row per token, its output index counting on."""
    return [SamplingRow(p, num_output_tokens=outputs + position, min_tokens_stop_ids=[0])
            for p, tokens in zip(params, drafts, strict=True) for position in range(len(tokens))]


@pytest.mark.parametrize("greedy_only", [True, False])
def test_verification_rows_drawn_in_the_graph_are_the_eager_samplers(tiny_qwen3: Path, greedy_only: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_rows, "KV_SHARE", 100.0)  # the tiny model's weights: see test_gpu_verify_rows.py
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    runner = ModelRunner(_config(tiny_qwen3, spec))
    tables = [[0, 1], [2, 3], [4, 5]]
    prompts = [list(range(3, 23)), [7] * 5, list(range(40, 57))]
    runner.execute(_batch(prompts, [0] * 3, tables, every_row=False))
    drafts = [[1, 2, 3, 4], [9], [10, 11, 12]]
    step = _batch(drafts, [len(p) for p in prompts], tables, every_row=True)
    params = [SamplingParams(temperature=0.0)] * 3 if greedy_only else \
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.3)]
    rows = _rows(params, drafts, outputs=3)
    assert runner.samples_in_graph(step)  # 8 rows: the bucket of 8, which samples
    in_graph, reference = Sampler(runner.device, seed=5), Sampler(runner.device, seed=5)
    sampling = in_graph.graph_params(rows)
    assert sampling is not None
    chosen = runner.execute_sampled(step, sampling).tolist()
    logits = runner.execute(step).float().clone()  # the same rows through the plain graph
    assert chosen == reference.draw(logits, rows).tolist()
    greedy = [index for index, row in enumerate(rows) if row.params.greedy]
    assert [chosen[index] for index in greedy] == logits[greedy].argmax(dim=-1).tolist()


def _generate(model: Path, spec: SpeculativeConfig | None,
              monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], int, int]:
    """Outputs, and the verification steps that drew in the graph and eagerly."""
    counts = {"graph": 0, "eager": 0}
    execute, execute_sampled = ModelRunner.execute, ModelRunner.execute_sampled

    def counted(self: ModelRunner, batch: BatchInput) -> torch.Tensor:
        counts["eager"] += not batch.is_decode and len(batch.logits_indices) == len(batch.token_ids)
        return execute(self, batch)

    def counted_sampled(self: ModelRunner, batch: BatchInput, sampling: GraphSampling) -> torch.Tensor:
        counts["graph"] += not batch.is_decode
        return execute_sampled(self, batch, sampling)

    monkeypatch.setattr(ModelRunner, "execute", counted)
    monkeypatch.setattr(ModelRunner, "execute_sampled", counted_sampled)
    config = _config(model, spec)
    return output_token_ids(config, ModelRunner(config), PROMPTS, PARAMS), counts["graph"], counts["eager"]


def test_an_engine_verifying_in_the_graph_gives_the_tokens_of_the_eager_sampler(
        tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_rows, "KV_SHARE", 100.0)
    expected, _, _ = _generate(tiny_qwen3, None, monkeypatch)
    oracle = parse_speculative_config({"method": "oracle", "num_speculative_tokens": 3, "oracle_acceptance": 0.7,
                                       "oracle_seed": 3, "oracle_tokens": list(zip(PROMPTS, expected, strict=True))},
                                      adaptive=False)
    got, in_graph, eager = _generate(tiny_qwen3, oracle, monkeypatch)
    assert got == expected and in_graph > 0 and eager == 0
    monkeypatch.setenv("VLLM_ACTORS_GRAPH_SAMPLER", "0")  # no graph draws: the eager sampler verifies
    got, in_graph, eager = _generate(tiny_qwen3, oracle, monkeypatch)
    assert got == expected and in_graph == 0 and eager > 0
