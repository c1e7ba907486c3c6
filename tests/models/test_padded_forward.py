"""Prefill and mixed steps padded for CUDA graphs (runner/padded_forward.py): the padded pass
gives the same logits as the unpadded one. Run on the CPU with the Triton kernels interpreted (the
padded rows rely on the Triton KV write skipping slot -1 and on the varlen kernel's empty programs);
the graphs themselves are captured on a GPU (tests/gpu/test_gpu_engine.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runner.model_runner import ModelRunner
from vllm_actors.runner.padded_forward import PaddedForward

BLOCK = 4


@pytest.fixture
def runner(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", device="cpu", block_size=BLOCK,
                          max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=32)
    return ModelRunner(config)


def _batch(token_ids: list[list[int]], starts: list[int], tables: list[list[int]]) -> BatchInput:
    """Sequence i computes ``token_ids[i]`` at positions starts[i].., sampling its last position."""
    batch = BatchInput([], [], [], [], [], [])
    for tokens, start, table in zip(token_ids, starts, tables, strict=True):
        batch.token_ids.extend(tokens)
        batch.positions.extend(range(start, start + len(tokens)))
        batch.query_lens.append(len(tokens))
        batch.seq_lens.append(start + len(tokens))
        batch.block_tables.append(table)
        batch.logits_indices.append(len(batch.token_ids) - 1)
    return batch


def test_padded_prefill_and_mixed_steps_match_the_unpadded_pass(runner: ModelRunner) -> None:
    padded = PaddedForward(runner, max_num_tokens=64, max_num_seqs=8)
    assert padded.sizes == [16, 32, 64]
    first = [[5, 9, 2, 7, 11, 3, 8], [4, 4, 6, 1]]
    tables = [[0, 1], [2, 3]]
    prefill = _batch(first, [0, 0], tables)
    eager = runner._run_eager(prefill)
    size = padded.bucket(prefill)
    assert size == 16
    assert torch.allclose(padded.run(prefill, size), eager, atol=1e-5)
    # a decode of the first sequence mixed with the next chunk of the second (their KV is cached)
    mixed = _batch([[12], [7, 7, 9]], [7, 4], tables)
    eager = runner._run_eager(mixed)
    assert torch.allclose(padded.run(mixed, padded.bucket(mixed) or 0), eager, atol=1e-5)
    # prompt-logprob rows (several per sequence) come out of the padded pass too
    several = _batch([[3, 1, 2]], [0], [[4]])
    several.logits_indices = [0, 1, 2]
    assert torch.allclose(padded.run(several, 16), runner._run_eager(several), atol=1e-5)


def test_steps_that_do_not_fit_are_not_padded(runner: ModelRunner) -> None:
    padded = PaddedForward(runner, max_num_tokens=64, max_num_seqs=2)
    assert padded.bucket(_batch([[1]] * 3, [0, 0, 0], [[0], [1], [2]])) is None  # more sequences than padded
    assert padded.bucket(_batch([[1] * 20], [0], [[0, 1, 2, 3, 4]])) == 32


def test_deferred_input_ids_are_filled_in_the_padded_pass(runner: ModelRunner) -> None:
    from vllm_actors.actors.worker.step_data import DeferredInputs

    padded = PaddedForward(runner, max_num_tokens=64, max_num_seqs=8)
    tables = [[0, 1], [2, 3]]
    runner._run_eager(_batch([[5, 9, 2, 7, 11, 3, 8], [4, 4, 6, 1]], [0, 0], tables))
    known = _batch([[12], [7, 7, 9]], [7, 4], tables)
    expected = runner._run_eager(known)
    # the decode token (12) and the chunk's last token (9) were sampled by a step not read back yet
    deferred = _batch([[0], [7, 7, 0]], [7, 4], tables)
    deferred.deferred = DeferredInputs(flat_index=[0, 3], source=torch.tensor([9, 30, 12]), source_row=[2, 0])
    assert torch.allclose(padded.run(deferred, 16), expected, atol=1e-5)
    deferred.deferred = DeferredInputs(flat_index=[0, 3], source=torch.tensor([9, 30, 12]), source_row=[2, 0])
    assert torch.allclose(runner._run_eager(deferred), expected, atol=1e-5)


def test_eager_and_padded_steps_fence_their_staging_set_once_its_copies_are_enqueued(runner: ModelRunner) -> None:
    from tests.models.test_staging import _Fences

    class _Model:  # the passes' outputs do not matter here: only the staging they go through
        def __call__(self, input_ids: torch.Tensor, *_: object) -> torch.Tensor:
            return torch.zeros(len(input_ids), 2)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    runner.model = _Model()
    fences = _Fences()
    runner._staging = runner._new_staging(fences)
    padded = PaddedForward(runner, max_num_tokens=64, max_num_seqs=8)
    tables = [[0, 1], [2, 3]]
    steps = [_batch([[5, 9, 2], [4, 4]], [0, 0], tables), _batch([[7], [6]], [3, 2], tables),
             _batch([[1, 2], [3]], [4, 3], tables)]
    for number, batch in enumerate(steps, start=1):
        if number == 2:
            padded.run(batch, padded.bucket(batch) or 0)
        else:
            runner._run_eager(batch)
        # recorded by the step itself (not at the next step's acquire); the third step reuses the first's set
        assert (fences.count("record"), fences.count("wait")) == (number, max(number - 2, 0))
