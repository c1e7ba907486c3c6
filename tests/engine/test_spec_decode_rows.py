"""Verification steps of many drafting requests as decode rows (runner/verify_rows.py) through the
in-process engine on the tiny Qwen3 (float32, Triton attention interpreted): the decode graphs are
stood in for by their static inputs and an eager pass over them (tests/gpu/test_gpu_verify_rows.py
replays real ones), so the query groups travel as on the GPU. Every verification step takes the
decode rows, though reading each sequence's KV once a row would cost past ``KV_SHARE`` (set low for
this model's small weights), and the greedy tokens are those of no speculation. Verification steps
whose tokens are drawn inside the decode graph (runner/graph_draws.py; the fused sampling kernel
interpreted, tests/gpu/test_gpu_graph_draws.py on real graphs): every one of greedy and seeded rows
takes the sampling graph, and the tokens are the eager sampler's and those of no speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.inprocess_runs import output_token_ids
from tests.support.stand_in_graphs import stand_in_decode_graphs
from tests.support.tiny_models import build_checkpoint
from vllm_actors.actors.worker.step_data import BatchInput, GraphSampling
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import SpeculativeConfig, parse_speculative_config
from vllm_actors.runner import verify_rows
from vllm_actors.runner.model_runner import ModelRunner
from vllm_actors.runner.verify_rows import extra_kv_bytes

SIZES = [8, 16, 24]
PROMPTS = [[(i * 13 + j * 7) % 500 for j in range(8 + 3 * i)] for i in range(6)]
MAX_TOKENS = 8


class StandInGraphs(ModelRunner):
    """The model runner with its decode graphs stood in for on the CPU; records the batches it runs."""

    def capture_graphs(self) -> None:
        self.executed: list[BatchInput] = []
        self.replayed: list[BatchInput] = []
        stand_in_decode_graphs(self, SIZES)

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.executed.append(batch)
        return super().execute(batch)

    def _run_graph(self, batch: BatchInput, bucket: int, sampling: GraphSampling | None = None) -> torch.Tensor:
        self.replayed.append(batch)
        return super()._run_graph(batch, bucket, sampling)


@pytest.fixture(scope="module")
def one_layer_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 cut to one layer and one KV head (4 queries a program): the interpreter's time."""
    return build_checkpoint(tmp_path_factory.mktemp("one_layer_qwen3"), "qwen3", tie_word_embeddings=True,
                            num_shards=1, shape={"num_hidden_layers": 1, "num_key_value_heads": 1})


def generate(model: Path, spec: SpeculativeConfig | None) -> tuple[list[list[int]], StandInGraphs]:
    config = EngineConfig(model=str(model), dtype="float32", device="cpu", block_size=4, max_num_seqs=16,
                          max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=128,
                          speculative_config=spec)
    runner = StandInGraphs(config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return output_token_ids(config, runner, PROMPTS, [params] * len(PROMPTS)), runner


def test_verification_of_many_drafting_requests_takes_the_decode_rows(one_layer_qwen3: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    # this model's weights are a fifth of its embedding: the rule tightened so that reading each sequence's
    # KV once a row would be refused here, as it is for SmolLM2-135M's from 8 drafting requests on
    monkeypatch.setattr(verify_rows, "KV_SHARE", 0.1)
    expected, _ = generate(one_layer_qwen3, None)
    oracle = parse_speculative_config({"method": "oracle", "num_speculative_tokens": 3, "oracle_acceptance": 0.7,
                                       "oracle_seed": 3, "oracle_tokens": list(zip(PROMPTS, expected, strict=True))},
                                      adaptive=False)
    got, runner = generate(one_layer_qwen3, oracle)
    assert got == expected
    verifying = [b for b in runner.executed if not b.is_decode and len(b.logits_indices) == len(b.token_ids)]
    rows = [b for b in runner.replayed if b.row_groups is not None]
    assert len(rows) == len(verifying) > 0  # every verification step replayed a decode graph as rows
    assert max(sum(count > 1 for count in b.row_groups or []) for b in rows) >= 5  # 5+ drafting requests a step
    kv_per_token = runner.bytes_per_block / runner.block_size
    assert any(extra_kv_bytes(b, kv_per_token) > verify_rows.KV_SHARE * runner._weight_bytes for b in verifying)


DRAW_PROMPTS = PROMPTS[:4]
# greedy and seeded rows in the same steps; the seeded ones stop first, so later steps are greedy alone
DRAW_PARAMS = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=0.9, seed=7, max_tokens=4, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=1.3, seed=11, max_tokens=4, ignore_eos=True)]


class RecordingRunner(ModelRunner):
    """Stood-in decode graphs (sampling ones up to ``max_num_seqs`` rows unless ``sample_in_graph`` is
    off); records the verification steps each execute path ran."""

    sample_in_graph = True

    def capture_graphs(self) -> None:
        self.eager_verifications: list[BatchInput] = []
        self.sampled_verifications: list[BatchInput] = []
        stand_in_decode_graphs(self, [8, 16], [8] if self.sample_in_graph else [])

    def execute(self, batch: BatchInput) -> torch.Tensor:
        if not batch.is_decode and len(batch.logits_indices) == len(batch.token_ids):
            self.eager_verifications.append(batch)
        return super().execute(batch)

    def execute_sampled(self, batch: BatchInput, sampling: GraphSampling) -> torch.Tensor:
        if not batch.is_decode:
            self.sampled_verifications.append(batch)
        return super().execute_sampled(batch, sampling)


class EagerRunner(RecordingRunner):
    sample_in_graph = False


def generate_drawing(model: Path, spec: SpeculativeConfig | None,
                     runner_class: type[RecordingRunner]) -> tuple[list[list[int]], RecordingRunner]:
    config = EngineConfig(model=str(model), dtype="float32", device="cpu", block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=128,
                          speculative_config=spec)
    runner = runner_class(config)
    return output_token_ids(config, runner, DRAW_PROMPTS, DRAW_PARAMS), runner


def test_verification_steps_draw_in_the_graph_as_the_eager_sampler_does(one_layer_qwen3: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")  # the fused kernel, eager or in the graph, as on a GPU
    monkeypatch.setattr(verify_rows, "KV_SHARE", 100.0)  # every verification step as decode rows
    expected, plain = generate_drawing(one_layer_qwen3, None, RecordingRunner)
    drafts = list(zip(DRAW_PROMPTS, expected, strict=True))
    oracle = parse_speculative_config({"method": "oracle", "num_speculative_tokens": 1, "oracle_acceptance": 0.7,
                                       "oracle_seed": 3, "oracle_tokens": drafts}, adaptive=False)
    in_graph, sampled = generate_drawing(one_layer_qwen3, oracle, RecordingRunner)
    eager, unsampled = generate_drawing(one_layer_qwen3, oracle, EagerRunner)
    assert in_graph == eager == expected
    # every verification step drew in the graph (none ran the eager sampler), the eager runner's never did
    assert sampled.sampled_verifications and not sampled.eager_verifications
    assert unsampled.eager_verifications and not unsampled.sampled_verifications
    assert len(sampled.sampled_verifications) == len(unsampled.eager_verifications)
    seeded_steps = [b for b in sampled.sampled_verifications if len(b.query_lens) == len(DRAW_PROMPTS)]
    greedy_steps = [b for b in sampled.sampled_verifications if len(b.query_lens) < len(DRAW_PROMPTS)]
    assert seeded_steps and greedy_steps  # steps with the seeded rows, and greedy rows alone
    assert not plain.eager_verifications and not plain.sampled_verifications
    # n-gram drafts, made by the worker just before the step: the same
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 2,
                                      "prompt_lookup_min": 1}, adaptive=False)
    drafted, sampled = generate_drawing(one_layer_qwen3, ngram, RecordingRunner)
    assert drafted == expected
    assert sampled.sampled_verifications and not sampled.eager_verifications
