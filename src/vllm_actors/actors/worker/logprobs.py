"""Logprobs read from logits: a chosen token's with its rank and the top few (``top_logprobs``),
and a request's prompt logprobs from the rows of the prompt positions a step ran (a chunked
prefill gives them chunk by chunk)."""

from __future__ import annotations

import torch

from vllm_actors.actors.worker.step_data import PromptSpan
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.messages import Logprobs, PromptLogprobs


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int) -> list[Logprobs]:
    """Chosen token first, then the top ``num_top`` (-1: the whole vocabulary, as vLLM), with
    1-based ranks. ``logprobs`` is [N, V]."""
    if num_top < 0 or num_top > logprobs.shape[1]:
        num_top = logprobs.shape[1]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=1) + 1
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=1)
    else:
        top_lp = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = chosen.new_empty((logprobs.shape[0], 0))
    chosen_list = chosen.tolist()
    chosen_lp_list = chosen_lp.squeeze(1).tolist()
    ranks_list = ranks.tolist()
    top_ids_list = top_ids.tolist()
    top_lp_list = top_lp.tolist()
    result = []
    for row in range(logprobs.shape[0]):
        result.append(
            Logprobs(
                token_ids=[chosen_list[row], *top_ids_list[row]],
                logprobs=[chosen_lp_list[row], *top_lp_list[row]],
                ranks=[ranks_list[row], *range(1, len(top_ids_list[row]) + 1)],
            )
        )
    return result


def prompt_logprobs_of(span: PromptSpan, logits: torch.Tensor) -> PromptLogprobs:
    """The span's entries: each target token's logprob and rank, then the top ``prompt_logprobs``."""
    request = span.request
    rows = logits[span.first_row : span.first_row + span.count]
    targets = upload(request.token_ids[span.first_target : span.first_target + span.count], rows.device)
    entries = top_logprobs(torch.log_softmax(rows.float(), dim=-1), targets, request.params.prompt_logprobs or 0)
    return PromptLogprobs(request_id=request.request_id, start=span.first_target, entries=entries)
