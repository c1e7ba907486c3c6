"""``prompt_logprobs``: the log-probabilities of a request's prompt tokens, from the logits rows of
the prompt positions a step ran (a chunked prefill gives them chunk by chunk)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_actors.actors.worker.sampler import top_logprobs
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.messages import PromptLogprobs

if TYPE_CHECKING:
    from vllm_actors.actors.worker.worker import WorkerRequest


@dataclass
class PromptSpan:
    request: WorkerRequest
    first_row: int  # first row of this span in the logits
    first_target: int  # prompt position whose logprob the first row gives
    count: int


def prompt_logprobs_of(span: PromptSpan, logits: torch.Tensor) -> PromptLogprobs:
    """The span's entries: each target token's logprob and rank, then the top ``prompt_logprobs``."""
    request = span.request
    rows = logits[span.first_row : span.first_row + span.count]
    targets = upload(request.token_ids[span.first_target : span.first_target + span.count], rows.device)
    entries = top_logprobs(torch.log_softmax(rows.float(), dim=-1), targets, request.params.prompt_logprobs or 0)
    return PromptLogprobs(request_id=request.request_id, start=span.first_target, entries=entries)
