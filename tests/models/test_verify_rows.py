"""Verification steps as decode rows (runner/verify_rows.py): one decode row per token gives the
logits of the varlen pass over the same tokens, for sequences of 1 to 8 new tokens mixed, in
float32 on the CPU with the Triton kernels interpreted; steps that are not verification-shaped, or
whose extra KV reads cost too much, keep their path; one KV read serves a program's worth of a
sequence's rows (query groups). The graphs themselves: tests/gpu/test_gpu_verify_rows.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_actors.actors.worker.step_data import BatchInput, SamplingRow, WorkerRequest
from vllm_actors.actors.worker.verify import expand_rows
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config
from vllm_actors.runner.model_runner import ModelRunner
from vllm_actors.runner.verify_rows import (
    as_decode_rows,
    decode_graph_rows,
    extra_kv_bytes,
    group_bounds,
    queries_per_read,
)

BLOCK = 4


@pytest.fixture(scope="module")
def runner(tiny_qwen3: Path) -> ModelRunner:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ACTORS_ATTENTION", "triton")
        patch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")
        config = EngineConfig(model=str(tiny_qwen3), dtype="float32", device="cpu", block_size=BLOCK,
                              max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=32)
        return ModelRunner(config)


def _batch(token_ids: list[list[int]], starts: list[int], tables: list[list[int]], every_row: bool) -> BatchInput:
    """Sequence i computes ``token_ids[i]`` at positions starts[i]..; logits of every token
    (``every_row``: a verification step) or of each sequence's last."""
    batch = BatchInput([], [], [], [], [], [])
    for tokens, start, table in zip(token_ids, starts, tables, strict=True):
        first = len(batch.token_ids)
        batch.token_ids.extend(tokens)
        batch.positions.extend(range(start, start + len(tokens)))
        batch.query_lens.append(len(tokens))
        batch.seq_lens.append(start + len(tokens))
        batch.block_tables.append(table)
        batch.logits_indices.extend(range(first, len(batch.token_ids)) if every_row else [len(batch.token_ids) - 1])
    return batch


def test_decode_rows_give_the_varlen_logits(runner: ModelRunner) -> None:
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    prompts = [[5, 9, 2, 7, 11, 3], [4, 4, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9], [13]]
    runner._run_eager(_batch(prompts, [0] * 4, tables, every_row=False))
    drafts = [[12, 7, 7, 9, 1, 2, 3, 4], [8], [6, 6, 5], [2, 3, 4, 5, 6]]  # 1 to 8 new tokens per sequence
    step = _batch(drafts, [len(p) for p in prompts], tables, every_row=True)
    step.block_table_array = step.table_array()
    rows = as_decode_rows(step, kv_bytes_per_token=1.0, weight_bytes=1e9)
    assert rows is not None and rows.is_decode and len(rows.query_lens) == len(step.token_ids)
    assert rows.seq_lens == [p + 1 for p in step.positions]
    assert np.array_equal(rows.table_array()[8], step.table_array()[1])  # row 8: the second sequence's token
    expected = runner._run_eager(step)
    assert torch.allclose(runner._run_eager(rows), expected, atol=1e-5)


def test_steps_that_are_not_verification_shaped_keep_their_path() -> None:
    tables = [[0, 1, 2]]
    assert as_decode_rows(_batch([[1, 2, 3]], [4], tables, every_row=False), 1.0, 1e9) is None  # last row only
    assert as_decode_rows(_batch([[1] * 9], [0], tables, every_row=True), 1.0, 1e9) is None  # above 8 tokens
    assert as_decode_rows(_batch([[1]], [4], tables, every_row=True), 1.0, 1e9) is None  # plain decode: its own graphs
    costly = _batch([[1, 2, 3, 4]], [40], tables, every_row=True)  # 3 extra rows reading 44 tokens each
    assert as_decode_rows(costly, kv_bytes_per_token=1.0, weight_bytes=4 * 132) is not None
    assert as_decode_rows(costly, kv_bytes_per_token=1.0, weight_bytes=4 * 131) is None


def test_one_kv_read_serves_a_programs_worth_of_rows() -> None:
    """The cost rule counts the reads beyond one per ``queries_per_read`` rows of a sequence."""
    tables = [[0, 1, 2], [3, 4, 5]]
    step = _batch([[1, 2, 3, 4, 5], [6, 7]], [40, 10], tables, every_row=True)  # 45 and 12 tokens read
    assert extra_kv_bytes(step, 1.0) == 4 * 45 + 12
    assert extra_kv_bytes(step, 1.0, queries_per_read=2) == 2 * 45
    assert extra_kv_bytes(step, 1.0, queries_per_read=5) == 0
    assert as_decode_rows(step, 1.0, weight_bytes=4.0, queries_per_read=5) is not None
    assert as_decode_rows(step, 1.0, weight_bytes=4 * 89.0, queries_per_read=2) is None


def test_rows_keep_their_sequences_as_query_groups() -> None:
    step = _batch([[1, 2, 3], [4], [5, 6]], [7, 3, 9], [[0, 1, 2], [3], [4, 5, 6]], every_row=True)
    rows = as_decode_rows(step, 1.0, 1e9)
    assert rows is not None and rows.row_groups == [3, 1, 2]
    assert group_bounds(rows, 8).tolist() == [[0, 0, 0, 3, 4, 4, 6, 7], [3, 3, 3, 4, 6, 6, 7, 8]]
    plain = _batch([[1], [2]], [3, 4], [[0], [1]], every_row=True)
    assert group_bounds(plain, 3).tolist() == [[0, 1, 2], [1, 2, 3]]  # rows alone, padding too
    # rows alone come from one shared read-only array; a grouped step's bounds do not write into it
    assert group_bounds(plain, 8) is group_bounds(plain, 8) and not group_bounds(plain, 8).flags.writeable
    assert group_bounds(rows, 8).flags.writeable and group_bounds(plain, 8).tolist()[1] == list(range(1, 9))


def test_query_groups_where_the_attention_has_them(runner: ModelRunner) -> None:
    """The Triton backend reads 16 // 2 rows of the tiny Qwen3 at once, only where the engine speculates."""
    config = runner.local_config
    assert queries_per_read(True, runner.model, config) == 8
    assert queries_per_read(False, runner.model, config) == 1
    assert queries_per_read(True, object(), config) == 1


def test_decode_graphs_hold_a_verification_step_of_every_sequence() -> None:
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert decode_graph_rows(64, 8192, None) == 64
    assert decode_graph_rows(64, 8192, spec) == 64 * 5
    assert decode_graph_rows(64, 256, spec) == 256  # the token budget
    assert decode_graph_rows(256, 128, spec) == 256  # never below a decode step's
    long = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_max": 3})
    assert decode_graph_rows(16, 8192, long) == 16 * 8  # MAX_QUERY_LEN rows a sequence


def test_expanded_rows_are_the_first_row_with_its_output_index_on() -> None:
    """expand_rows builds each draft's row field by field: every field of the request's row is carried
    (a field added to SamplingRow and not carried fails here), and each row has the drafts before it."""
    params = SamplingParams(temperature=0.7, seed=3, min_tokens=9, stop_token_ids=[5], max_tokens=20)
    request = WorkerRequest("r", [1, 2, 3, 4], num_prompt_tokens=3, num_output_tokens=1, params=params,
                            eos_token_ids=[2], penalty_slot=4)
    rows, owners = expand_rows([request], [[7, 8]])
    first = request.sampling_row()
    assert rows == [first] + [SamplingRow(**{**vars(first), "num_output_tokens": 1 + i, "drafted": [7, 8][:i]})
                              for i in (1, 2)]
    assert rows[1].output_token_ids() == [4, 7] and rows[2].output_token_ids() == [4, 7, 8]
    assert owners == [request] * 3 and rows[2].penalty_slot == 4 and rows[1].min_tokens_stop_ids == [2, 5]
