"""Verification steps whose tokens are drawn inside the decode graph (runner/graph_draws.py), through
the in-process engine on a one-layer tiny Qwen3 (float32, Triton attention and the fused sampling
kernel interpreted): the decode graphs, plain and sampling, are stood in for by eager passes over
their static inputs (tests/gpu/test_gpu_graph_draws.py replays real ones). Every verification step
of greedy and seeded rows takes the sampling graph, and the tokens are those of the eager sampler
over the same steps and those of no speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.stand_in_graphs import stand_in_decode_graphs
from tests.support.tiny_models import build_checkpoint
from vllm_actors.actors.worker.step_data import BatchInput, GraphSampling
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import SpeculativeConfig, parse_speculative_config
from vllm_actors.runner import verify_rows
from vllm_actors.runner.model_runner import ModelRunner

PROMPTS = [[(i * 13 + j * 7) % 500 for j in range(8 + 3 * i)] for i in range(4)]
# greedy and seeded rows in the same steps; the seeded ones stop first, so later steps are greedy alone
PARAMS = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
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


@pytest.fixture(scope="module")
def one_layer_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("one_layer_qwen3"), "qwen3", tie_word_embeddings=True,
                            num_shards=1, shape={"num_hidden_layers": 1, "num_key_value_heads": 1})


def generate(model: Path, spec: SpeculativeConfig | None,
             runner_class: type[RecordingRunner]) -> tuple[list[list[int]], RecordingRunner]:
    config = EngineConfig(model=str(model), dtype="float32", device="cpu", block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=128,
                          speculative_config=spec)
    runner = runner_class(config)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    for index, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt}, params))
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished:
        finished.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    engine.check_idle_invariants()
    return [finished[str(index)] for index in range(len(PROMPTS))], runner


def test_verification_steps_draw_in_the_graph_as_the_eager_sampler_does(one_layer_qwen3: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")  # the fused kernel, eager or in the graph, as on a GPU
    monkeypatch.setattr(verify_rows, "KV_SHARE", 100.0)  # every verification step as decode rows
    expected, plain = generate(one_layer_qwen3, None, RecordingRunner)
    oracle = parse_speculative_config({"method": "oracle", "num_speculative_tokens": 1, "oracle_acceptance": 0.7,
                                       "oracle_seed": 3, "oracle_tokens": list(zip(PROMPTS, expected, strict=True))},
                                      adaptive=False)
    in_graph, sampled = generate(one_layer_qwen3, oracle, RecordingRunner)
    eager, unsampled = generate(one_layer_qwen3, oracle, EagerRunner)
    assert in_graph == eager == expected
    # every verification step drew in the graph (none ran the eager sampler), the eager runner's never did
    assert sampled.sampled_verifications and not sampled.eager_verifications
    assert unsampled.eager_verifications and not unsampled.sampled_verifications
    assert len(sampled.sampled_verifications) == len(unsampled.eager_verifications)
    seeded_steps = [b for b in sampled.sampled_verifications if len(b.query_lens) == len(PROMPTS)]
    greedy_steps = [b for b in sampled.sampled_verifications if len(b.query_lens) < len(PROMPTS)]
    assert seeded_steps and greedy_steps  # steps with the seeded rows, and greedy rows alone
    assert not plain.eager_verifications and not plain.sampled_verifications
    # n-gram drafts, made by the worker just before the step: the same
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 2,
                                      "prompt_lookup_min": 1}, adaptive=False)
    drafted, sampled = generate(one_layer_qwen3, ngram, RecordingRunner)
    assert drafted == expected
    assert sampled.sampled_verifications and not sampled.eager_verifications
