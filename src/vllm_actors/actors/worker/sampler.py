"""Token sampling for a batch in which every row has its own parameters.

Order of operations per row (vLLM's): mask stop tokens while fewer than ``min_tokens`` outputs
exist; greedy rows take the argmax; the other rows divide by temperature, keep the top-k, the
top-p nucleus and the tokens above ``min_p`` times the largest probability, and draw with the
exponential race (argmax of p / E, E ~ Exp(1)), which samples exactly from p.

Seeds: a row with a seed draws its noise from a generator seeded by (seed, output index), so the
token it gets depends on nothing else in the batch, nor on preemptions. Rows without a seed share
the engine's generator. Logprobs are those of the model's raw distribution (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_actors.protocol.messages import Logprobs
from vllm_actors.protocol.sampling import SamplingParams

_MASK = float("-inf")
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) pairs apart


@dataclass
class SamplingRow:
    params: SamplingParams
    num_output_tokens: int  # outputs before this one: the index of the token being drawn
    min_tokens_stop_ids: list[int]  # ids masked while num_output_tokens < min_tokens


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


def seeded_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MIX + output_index) % (1 << 63))
    return generator


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int) -> list[Logprobs]:
    """Chosen token first, then the top ``num_top``, with 1-based ranks. ``logprobs`` is [N, V]."""
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


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """``logits`` is [N, V] float32, one row per request that samples this step."""
        logits = logits.float()
        num_rows = logits.shape[0]
        wants_logprobs = [row.params.logprobs is not None for row in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None

        logits = self._mask_min_tokens(logits, rows)
        chosen = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        greedy = [index for index, row in enumerate(rows) if row.params.greedy]
        random = [index for index, row in enumerate(rows) if not row.params.greedy]
        if not random:  # all greedy: no copies of the logits
            chosen = logits.argmax(dim=-1)
        elif not greedy:  # all sampled
            chosen = self._sample(logits, rows)
        else:
            index = torch.tensor(greedy, device=logits.device)
            chosen[index] = logits[index].argmax(dim=-1)
            index = torch.tensor(random, device=logits.device)
            chosen[index] = self._sample(logits[index], [rows[i] for i in random])

        token_ids = chosen.tolist()
        logprobs: list[Logprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            asking = [index for index, wants in enumerate(wants_logprobs) if wants]
            num_top = max(rows[index].params.logprobs or 0 for index in asking)
            index = torch.tensor(asking, device=logits.device)
            entries = top_logprobs(raw_logprobs[index], chosen[index], num_top)
            for row_index, entry in zip(asking, entries, strict=True):
                wanted = rows[row_index].params.logprobs or 0
                logprobs[row_index] = Logprobs(
                    token_ids=entry.token_ids[: wanted + 1],
                    logprobs=entry.logprobs[: wanted + 1],
                    ranks=entry.ranks[: wanted + 1],
                )
        return SampleResult(token_ids=token_ids, logprobs=logprobs)

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        masked = None
        for index, row in enumerate(rows):
            if row.num_output_tokens < row.params.min_tokens and row.min_tokens_stop_ids:
                if masked is None:
                    masked = logits.clone()
                ids = [i for i in row.min_tokens_stop_ids if i < logits.shape[1]]
                masked[index, ids] = _MASK
        return logits if masked is None else masked

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        device = logits.device
        temperatures = {row.params.temperature for row in rows}
        if len(temperatures) == 1:  # one value for the batch (the common case): no tensor to build
            logits = logits / temperatures.pop()
        else:
            temperature = torch.tensor([row.params.temperature for row in rows], device=device)
            logits = logits / temperature.unsqueeze(1)

        top_k = [row.params.top_k for row in rows]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[1]
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=device)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, _MASK)

        top_p = [row.params.top_p for row in rows]
        if any(p < 1.0 for p in top_p):
            p = torch.tensor(top_p, device=device)
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= (1.0 - p).unsqueeze(1)
            drop_sorted[:, -1] = False  # always keep the most likely token
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, _MASK)

        probs = logits.softmax(dim=-1)
        min_p = [row.params.min_p for row in rows]
        if any(m > 0.0 for m in min_p):
            m = torch.tensor(min_p, device=device).unsqueeze(1)
            threshold = probs.max(dim=-1, keepdim=True).values * m
            probs = probs.masked_fill(probs < threshold, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [index for index, row in enumerate(rows) if row.params.seed is None]
        if len(unseeded) == len(rows):  # one draw for the whole batch
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise[unseeded] = torch.empty(
                (len(unseeded), probs.shape[1]), device=device
            ).exponential_(generator=self.generator)
        for index, row in enumerate(rows):
            if row.params.seed is not None:
                generator = seeded_generator(row.params.seed, row.num_output_tokens, device)
                noise[index].exponential_(generator=generator)
        return probs.div_(noise).argmax(dim=-1)
