"""Verification steps as decode rows, so the captured decode graphs serve them.

A speculative step gives each drafting sequence a few new tokens (its last known token and its
drafts), every one of them a logits row; plain decodes beside them have one. Such a step would take
the padded varlen path (``padded_forward.py``: GEMMs and attention tiles sized for at least 16
tokens and ``max_num_seqs`` sequences, several input copies). Here it becomes one decode row per
token: the row's token, position ``p`` and KV slot, sequence length ``p + 1`` and its sequence's
block-table row repeated. Each layer writes every row's KV before it attends, so a row attends to
its sequence's context and to the drafts before it, and to nothing after: the causal attention of
the varlen pass, row for row. The logits rows are the tokens, in the same order.

A sequence's rows stay one query group (``row_groups``, then the attention metadata's
``decode_groups``): the Triton decode kernel attends up to ``queries_per_read`` of them with one read
of the sequence's KV (``kernels/triton_decode.py``); a backend that attends each row alone reads it
once a row. A speculating engine captures decode graphs for up to ``max_num_seqs`` sequences' worth
of verification rows (``decode_graph_rows``, within the token budget and the largest graph size).
The reads beyond one per sequence are allowed while their bytes stay within ``KV_SHARE`` of the
weights' bytes (which every decode step reads once), and a sequence takes at most ``MAX_QUERY_LEN``
tokens; otherwise the step keeps the padded path.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import structlog
import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.models.config import ModelConfig
from vllm_actors.protocol.speculative import SpeculativeConfig

log = structlog.get_logger(__name__)

MAX_QUERY_LEN = 8  # new tokens per sequence: 1 + up to 7 drafts
KV_SHARE = 0.25  # the extra KV reads allowed, as a share of the weights' bytes


def extra_kv_bytes(batch: BatchInput, kv_bytes_per_token: float, queries_per_read: int = 1) -> float:
    """The KV bytes the decode rows read beyond one read of each sequence's context, when one read
    serves up to ``queries_per_read`` of a sequence's rows."""
    rereads = sum((math.ceil(count / queries_per_read) - 1) * length
                  for count, length in zip(batch.query_lens, batch.seq_lens, strict=True))
    return rereads * kv_bytes_per_token


def as_decode_rows(batch: BatchInput, kv_bytes_per_token: float, weight_bytes: float,
                   queries_per_read: int = 1) -> BatchInput | None:
    """The step as one decode row per token (module docstring), or None where it is not a
    verification-shaped step (a row that returns no logits, a sequence of more than
    ``MAX_QUERY_LEN`` tokens) or the rows' extra KV reads cost more than ``KV_SHARE`` allows.
    ``queries_per_read``: a sequence's rows the attention serves with one read of its KV."""
    num_tokens = len(batch.token_ids)
    if not num_tokens or batch.is_decode or max(batch.query_lens) > MAX_QUERY_LEN:
        return None
    if len(batch.logits_indices) != num_tokens or batch.logits_indices != list(range(num_tokens)):
        return None
    if extra_kv_bytes(batch, kv_bytes_per_token, queries_per_read) > KV_SHARE * weight_bytes:
        return None
    sequence_of_row = np.repeat(np.arange(len(batch.query_lens)), batch.query_lens)
    sequences = sequence_of_row.tolist()
    return BatchInput(
        token_ids=batch.token_ids,
        positions=batch.positions,
        query_lens=[1] * num_tokens,
        seq_lens=[position + 1 for position in batch.positions],
        block_tables=[batch.block_tables[row] for row in sequences],
        logits_indices=batch.logits_indices,
        block_table_array=None if batch.block_table_array is None else batch.block_table_array[sequence_of_row],
        table_rows=None if batch.table_rows is None else batch.table_rows.select(sequence_of_row),
        deferred=batch.deferred,  # the same flat token indices
        loras=None if batch.loras is None else [batch.loras[row] for row in sequences],
        row_groups=list(batch.query_lens),
    )


def decode_graph_rows(max_num_seqs: int, max_num_tokens: int, speculative: SpeculativeConfig | None) -> int:
    """Rows the largest decode graph needs: a decode step's ``max_num_seqs``, or where the engine
    speculates a verification step's of as many sequences (1 + k rows each, at most ``MAX_QUERY_LEN``),
    within the step's token budget (the graphs above ``max_num_seqs`` only ever verify)."""
    if speculative is None:
        return max_num_seqs
    per_sequence = min(1 + speculative.num_speculative_tokens, MAX_QUERY_LEN)
    return max(max_num_seqs, min(max_num_seqs * per_sequence, max_num_tokens))


@functools.lru_cache(maxsize=64)
def _rows_alone(rows: int) -> np.ndarray:
    """``decode_groups`` of ``rows`` rows each its own group, read-only (kept: every plain step of a
    speculating engine uploads them)."""
    bounds = np.empty((2, rows), dtype=np.int32)
    bounds[0] = np.arange(rows)
    bounds[1] = bounds[0] + 1
    bounds.setflags(write=False)
    return bounds


def group_bounds(batch: BatchInput, rows: int) -> np.ndarray:
    """``decode_groups`` of ``rows`` decode rows (the batch's, then padding): int32 [2, rows], each row's
    group's first and end row; rows alone (padding, or a batch without ``row_groups``) are their own group.
    Read-only where the batch has no groups (a shared array: copy it to write)."""
    alone = _rows_alone(rows)
    if not batch.row_groups:
        return alone
    bounds = alone.copy()
    counts = np.asarray(batch.row_groups, dtype=np.int32)
    ends = np.cumsum(counts, dtype=np.int32)
    used = int(ends[-1])
    bounds[0, :used] = np.repeat(ends - counts, counts)
    bounds[1, :used] = np.repeat(ends, counts)
    return bounds


def queries_per_read(speculating: bool, model: object, local_config: ModelConfig, block_size: int = 16) -> int:
    """How many of a sequence's decode rows the model's attention serves with one read of its KV: the
    Triton backend's query groups (``decode_queries_per_read``) where the engine speculates, else 1
    (plain decode graphs then read no query groups). On a GPU the grouped kernel is run once first
    (``grouped_decode_agrees``): where it fails or disagrees, 1 and a warning, so that verification keeps the
    padded path rather than the engine failing at capture."""
    per_read = getattr(getattr(model, "attn_backend", None), "decode_queries_per_read", None)
    if not speculating or not callable(per_read):
        return 1
    reads = int(per_read(local_config.num_attention_heads, local_config.num_key_value_heads))
    floats = (torch.bfloat16, torch.float16, torch.float32)  # the compute dtype (not an fp8 weight's)
    parameter = next((p for p in model.parameters() if p.dtype in floats), None) \
        if isinstance(model, torch.nn.Module) else None
    if reads > 1 and parameter is not None and parameter.is_cuda:  # checked once on the device before capture
        from vllm_actors.kernels.decode_groups_check import grouped_decode_agrees

        why = grouped_decode_agrees(parameter.device, parameter.dtype, local_config.num_attention_heads,
                                    local_config.num_key_value_heads, local_config.head_dim, block_size)
        if why is not None:
            log.warning("decode_query_groups_off", why=why)
            return 1
    return reads
