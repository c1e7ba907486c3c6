"""Verification steps of many drafting requests as decode rows (runner/verify_rows.py) through the
in-process engine on the tiny Qwen3 (float32, Triton attention interpreted): the decode graphs are
stood in for by their static inputs and an eager pass over them (tests/gpu/test_gpu_verify_rows.py
replays real ones), so the query groups travel as on the GPU. Every verification step takes the
decode rows, though reading each sequence's KV once a row would cost past ``KV_SHARE`` (set low for
this model's small weights), and the greedy tokens are those of no speculation."""

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
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt}, params))
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished:
        finished.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    engine.check_idle_invariants()
    return [finished[str(index)] for index in range(len(PROMPTS))], runner


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
