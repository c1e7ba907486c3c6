"""vLLM's logits controls, per row of a batch, on the logits' device, before the draw.

vLLM v1's sampler order (``vllm/v1/sample/sampler.py``): logits to float32; the
``allowed_token_ids`` whitelist; bad words (the last token of a word whose other tokens end the
output); the processors that can change the argmax (min_tokens - done by the sampler after this,
its -inf is absorbing so the order does not matter - and ``logit_bias``, here clamped to
[-100, 100] as OpenAI's API); then the penalties: repetition over prompt and output tokens
(positive logits divided by it, negative ones multiplied), frequency (times the count of each
token in the output) and presence (once per token in the output) subtracted.

A verification row of speculative decoding (``SamplingRow.drafted``) sees the drafts before it as
output: its bad words and penalties count them (a pooled row: its slot's counts plus theirs).

Rows without any control cost nothing: ``apply_controls`` returns the logits untouched when no
row has one. A penalised row with a slot in a ``PenaltyPool`` (the worker's rows) reads its prompt's
tokens and output counts from there, on the device, in one Triton pass on a GPU
(``kernels/penalties.py``); one without (the sampler alone, in tests) has its token lists sent to
the device for this step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_actors.actors.worker.step_data import SamplingRow
from vllm_actors.actors.worker.uploads import fill_at, upload
from vllm_actors.kernels import penalties as kernel
from vllm_actors.runner.penalty_pool import PenaltyPool

_MASK = float("-inf")
MAX_BIAS = 100.0


def apply_controls(logits: torch.Tensor, rows: Sequence[SamplingRow], pool: PenaltyPool | None = None) -> torch.Tensor:
    """The logits with every row's controls applied (a float32 copy), or ``logits`` itself when
    no row has any. ``pool``: where the rows with a ``penalty_slot`` keep their token counts."""
    active = [index for index, row in enumerate(rows) if row.params.has_controls]
    if not active:
        return logits
    logits = logits.to(torch.float32, copy=True)
    _allowed(logits, rows, active)
    _bad_words(logits, rows, active)
    _logit_bias(logits, rows, active)
    _penalties(logits, rows, active, pool)
    return logits


def _allowed(logits: torch.Tensor, rows: Sequence[SamplingRow], active: list[int]) -> None:
    vocab = logits.shape[1]
    masked_rows, keep_rows, keep_ids = [], [], []
    for index in active:
        allowed = rows[index].params.allowed_token_ids
        if allowed is None:
            continue
        masked_rows.append(index)
        ids = [token_id for token_id in allowed if token_id < vocab]
        keep_rows += [index] * len(ids)
        keep_ids += ids
    if not masked_rows:
        return
    drop = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    fill_at(drop, (upload(masked_rows, logits.device, torch.long),), True)
    fill_at(drop, (upload(keep_rows, logits.device, torch.long), upload(keep_ids, logits.device, torch.long)), False)
    logits.masked_fill_(drop, _MASK)


def banned_by_bad_words(words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The last token of every word whose other tokens end ``output`` (vLLM's rule)."""
    banned = []
    for word in words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix:]) == list(word[:prefix]):
            banned.append(word[-1])
    return banned


def _bad_words(logits: torch.Tensor, rows: Sequence[SamplingRow], active: list[int]) -> None:
    vocab = logits.shape[1]
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for index in active:
        row = rows[index]
        words = row.params.bad_words_token_ids
        if not words:
            continue
        ids = [t for t in banned_by_bad_words(words, row.output_token_ids()) if t < vocab]
        ban_rows += [index] * len(ids)
        ban_ids += ids
    if ban_rows:
        where = (upload(ban_rows, logits.device, torch.long), upload(ban_ids, logits.device, torch.long))
        fill_at(logits, where, _MASK)


def _logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow], active: list[int]) -> None:
    vocab = logits.shape[1]
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    biases: list[float] = []
    for index in active:
        for token_id, bias in (rows[index].params.logit_bias or {}).items():
            if token_id < vocab:
                bias_rows.append(index)
                bias_ids.append(token_id)
                biases.append(min(MAX_BIAS, max(-MAX_BIAS, float(bias))))
    if bias_rows:
        where = (upload(bias_rows, logits.device, torch.long), upload(bias_ids, logits.device, torch.long))
        logits.index_put_(where, upload(biases, logits.device, torch.float32), accumulate=True)


def _penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], active: list[int], pool: PenaltyPool | None) -> None:
    penalised = [index for index in active if rows[index].params.has_penalties]
    pooled = [index for index in penalised if pool is not None and rows[index].penalty_slot >= 0]
    listed = [index for index in penalised if pool is None or rows[index].penalty_slot < 0]
    vocab = logits.shape[1]
    drafting = [index for index in pooled if rows[index].drafted]  # verification rows past the first
    pooled = [index for index in pooled if not rows[index].drafted]
    if pooled:
        assert pool is not None
        pool.penalise(logits, pooled, [rows[index].penalty_slot for index in pooled], _scalars(rows, pooled, logits))
    if drafting:  # the slot's counts and the drafts before the row
        assert pool is not None
        seen, counts = pool.read([rows[index].penalty_slot for index in drafting], vocab)
        counts += _counts([rows[index].drafted for index in drafting], vocab, logits)
        kernel.apply_penalties_torch(logits, upload(drafting, logits.device, torch.long),
                                     torch.arange(len(drafting), device=logits.device), seen, counts,
                                     _scalars(rows, drafting, logits))
    if listed:  # their counts built for this step, one row each, in the pool's layout
        prompts = [rows[index].prompt_token_ids() for index in listed]
        outputs = [rows[index].output_token_ids() for index in listed]
        kernel.apply_penalties_torch(logits, upload(listed, logits.device, torch.long),
                                     torch.arange(len(listed), device=logits.device),
                                     _counts(prompts, vocab, logits) > 0, _counts(outputs, vocab, logits),
                                     _scalars(rows, listed, logits))


def _scalars(rows: Sequence[SamplingRow], penalised: list[int], logits: torch.Tensor) -> torch.Tensor:
    """[3, n] float32 on the logits' device: repetition, frequency and presence of each row."""
    params = [rows[index].params for index in penalised]
    return upload([p.repetition_penalty for p in params] + [p.frequency_penalty for p in params]
                  + [p.presence_penalty for p in params], logits.device, torch.float32).view(3, len(penalised))


def _counts(token_lists: Sequence[Sequence[int]], vocab: int, logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] float32 counts of each token in each list: one copy to the device and one
    scatter there (ids outside the vocabulary, and the padding, land in a dropped last column)."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32, device=logits.device)
    if width == 0:
        return counts[:, :vocab]
    flat: list[int] = []
    for tokens in token_lists:
        flat += tokens
        flat += [vocab] * (width - len(tokens))
    ids = upload(flat, logits.device, torch.long).view(len(token_lists), width)
    ids = torch.where((ids < 0) | (ids > vocab), vocab, ids)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]
