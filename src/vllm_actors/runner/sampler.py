"""Token sampling for a batch in which every row has its own parameters.

Order of operations per row (vLLM's): mask stop tokens while fewer than ``min_tokens`` outputs
exist; greedy rows take the argmax; the other rows divide by temperature, keep the top-k, the
top-p nucleus and the tokens above ``min_p`` times the largest probability, and draw with the
exponential race (argmax of p / E, E ~ Exp(1)), which samples exactly from p.

On a GPU, a batch whose rows use neither top-k, top-p nor min-p is drawn by one fused Triton kernel
(``kernels/sampling.py``: temperature and Gumbel-max in one read of the logits, greedy rows mixed
in); its noise is Philox keyed per row, so a seeded row's token still depends only on its seed and
output index. ``VLLM_ACTORS_SAMPLER=torch`` forces the torch path, ``=triton`` the kernel on any
device (tests run it on the CPU under TRITON_INTERPRET=1).

Seeds: a row with a seed draws its noise from a generator seeded by (seed, output index), so the
token it gets depends on nothing else in the batch, nor on preemptions. Rows without a seed share
the engine's generator. Logprobs are those of the model's raw distribution (vLLM's default).

Before all of this, ``penalties.apply_controls`` applies vLLM's logits controls (allowed token ids,
bad words, logit_bias, repetition/frequency/presence penalties) to the rows that set them.
"""

from __future__ import annotations

import torch

from vllm_actors.actors.worker.logprobs import top_logprobs
from vllm_actors.actors.worker.step_data import GraphSampling, SampleResult, SamplingRow
from vllm_actors.actors.worker.uploads import fill_at, upload
from vllm_actors.kernels import sampling as fused_sampling
from vllm_actors.kernels.choice import use_triton
from vllm_actors.protocol.messages import Logprobs
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.penalties import apply_controls
from vllm_actors.runner.penalty_pool import PenaltyPool

_MASK = float("-inf")
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) pairs apart
_ROW_MIX = 0x5851F42D4C957F2D  # another, below 2**63: spreads a step's rows apart


def _filters(params: SamplingParams) -> bool:
    """Top-k, top-p or min-p: the rows the fused kernel does not take."""
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def seeded_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * _SEED_MIX + output_index) % (1 << 63))
    return generator


def fused_sampler_enabled(device: torch.device) -> bool:
    """The fused sampling kernel (``VLLM_ACTORS_SAMPLER``: ``torch`` or ``triton``)."""
    return use_triton("VLLM_ACTORS_SAMPLER", fused_sampling.HAVE_TRITON, device)


def row_seed(seed: int, output_index: int) -> int:
    """The fused kernel's Philox key of a seeded row's ``output_index``-th draw."""
    return (seed * _SEED_MIX + output_index) & fused_sampling.SEED_MASK


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.fused = fused_sampler_enabled(device)
        self._seed = seed
        self._draws = 0  # fused draws so far: keys the unseeded rows' noise of each step
        # The penalised rows' token counts on the device: the worker gives each such request a slot.
        self.penalties = PenaltyPool(device)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], count: bool = True) -> SampleResult:
        """``logits`` is [N, V] (float32, or the model's half type on a GPU), one row per request
        that samples this step. ``count``: as ``draw``'s."""
        num_rows = logits.shape[0]
        wants_logprobs = [row.params.logprobs is not None for row in rows]
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if any(wants_logprobs) else None

        chosen = self.draw(logits, rows, count)
        token_ids = chosen.tolist()
        logprobs: list[Logprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            asking = [index for index, wants in enumerate(wants_logprobs) if wants]
            vocab = raw_logprobs.shape[1]
            wants = [vocab if (rows[i].params.logprobs or 0) < 0 else rows[i].params.logprobs or 0 for i in asking]
            index = upload(asking, logits.device)
            entries = top_logprobs(raw_logprobs[index], chosen[index], max(wants))
            for row_index, entry, wanted in zip(asking, entries, wants, strict=True):
                logprobs[row_index] = Logprobs(
                    token_ids=entry.token_ids[: wanted + 1],
                    logprobs=entry.logprobs[: wanted + 1],
                    ranks=entry.ranks[: wanted + 1],
                )
        return SampleResult(token_ids=token_ids, logprobs=logprobs)

    def draw(self, logits: torch.Tensor, rows: list[SamplingRow], count: bool = True) -> torch.Tensor:
        """The chosen token of every row, left on the logits' device (no host round trip). Greedy
        rows and the fused kernel read half-precision logits as they are (exactly: the argmax of a
        bfloat16 row is that of its float32 copy); the torch sampling path works in float32.
        ``count``: the penalised rows' tokens counted in their slots (not a verification's read back
        at once: the worker counts the tokens it keeps, ``PenaltyPool.count_kept``)."""
        num_rows = logits.shape[0]
        logits = apply_controls(logits, rows, self.penalties)  # penalties, logit_bias, allowed ids, bad words
        logits = self._mask_min_tokens(logits, rows)
        chosen = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        greedy = [index for index, row in enumerate(rows) if row.params.greedy]
        random = [index for index, row in enumerate(rows) if not row.params.greedy]
        if not random:  # all greedy: no copies of the logits
            chosen = logits.argmax(dim=-1)
        elif self._fused_draw(rows):
            chosen = self._sample_fused(logits, rows)
        elif not greedy:  # all sampled
            chosen = self._sample(logits, rows)
        else:
            index = upload(greedy, logits.device)
            chosen[index] = logits[index].argmax(dim=-1)
            index = upload(random, logits.device)
            chosen[index] = self._sample(logits[index], [rows[i] for i in random])
        if count:
            self._count_penalised(chosen, rows)
        return chosen

    def _count_penalised(self, chosen: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Each pooled penalised row's drawn token counted on the device, before the next step (only
        penalised requests get a slot)."""
        pooled = [index for index, row in enumerate(rows) if row.penalty_slot >= 0]
        if not pooled:
            return
        picked = chosen if len(pooled) == len(rows) else chosen[upload(pooled, chosen.device)]
        self.penalties.record([rows[index].penalty_slot for index in pooled], picked)

    def graph_params(self, rows: list[SamplingRow]) -> GraphSampling | None:
        """The fused kernel's per-row inputs when ``draw`` would be that kernel alone (or a plain
        argmax) on these rows, for a decode graph that samples inside it; None when a row needs
        more (top-k/p, min-p, logits controls, a min_tokens mask). Same noise as ``draw``."""
        if not self.fused:
            return None
        for row in rows:
            params = row.params
            if _filters(params) or params.has_controls or params.structured_outputs is not None:
                return None  # a grammar's mask comes from the host between the logits and the draw
            if row.num_output_tokens < params.min_tokens and row.min_tokens_stop_ids:
                return None
        step_key = 0 if all(row.params.greedy for row in rows) else self._next_step_key()
        return self._row_inputs(rows, step_key)

    def follow_draw(self, rows: list[SamplingRow]) -> None:
        """Advance the step key as ``draw`` of these rows does, without drawing: a tensor-parallel
        rank above 0 does this where rank 0 draws and broadcasts, so that every rank's keys stay
        equal for the steps that each rank draws in its own decode graph."""
        if any(not row.params.greedy for row in rows) and self._fused_draw(rows):
            self._next_step_key()

    def _fused_draw(self, rows: list[SamplingRow]) -> bool:
        """Whether ``draw`` takes these rows (some not greedy) through the fused kernel, which uses
        one step key; ``follow_draw`` asks the same question, so the two cannot drift apart."""
        return self.fused and not any(_filters(row.params) for row in rows)

    def _next_step_key(self) -> int:
        """The Philox key of this draw's unseeded rows (one per fused draw)."""
        self._draws += 1
        return (self._seed * _SEED_MIX + self._draws * 0x2545F4914F6CDD1D) & fused_sampling.SEED_MASK

    @staticmethod
    def _row_inputs(rows: list[SamplingRow], step_key: int) -> GraphSampling:
        """Per row: inverse temperature, noise scale (0: greedy) and Philox key."""
        inv: list[float] = []
        noise: list[float] = []
        seeds: list[int] = []
        for index, row in enumerate(rows):
            greedy = row.params.greedy
            inv.append(1.0 if greedy else 1.0 / row.params.temperature)
            noise.append(0.0 if greedy else 1.0)
            if row.params.seed is not None:
                seeds.append(row_seed(row.params.seed, row.num_output_tokens))
            else:
                seeds.append((index * _ROW_MIX + step_key) & fused_sampling.SEED_MASK)
        return GraphSampling(inv, noise, seeds)

    @staticmethod
    def needs_host(params: SamplingParams) -> bool:
        """Whether a row's draw needs more than ``draw`` (logprobs, read back with the tokens):
        such a step cannot be launched before the previous step's tokens are on the host; nor can
        one whose bad words read the tokens generated so far. Penalties do not (the worker's rows
        keep their counts on the device, ``PenaltyPool``), nor structured outputs (the worker
        launches the forward pass, then feeds the previous step's tokens to the matchers and fills
        the masks while it runs)."""
        return params.logprobs is not None or params.prompt_logprobs is not None or bool(params.bad_words_token_ids)

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for index, row in enumerate(rows):
            if row.num_output_tokens < row.params.min_tokens and row.min_tokens_stop_ids:
                ids = [i for i in row.min_tokens_stop_ids if i < logits.shape[1]]
                mask_rows += [index] * len(ids)
                mask_ids += ids
        if not mask_rows:
            return logits
        masked = logits.clone()
        fill_at(masked, (upload(mask_rows, logits.device), upload(mask_ids, logits.device)), _MASK)
        return masked

    def _sample_fused(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Every row (greedy ones too) in one kernel launch."""
        device = logits.device
        num_rows = len(rows)
        step_key = self._next_step_key()
        if all(row.params.seed is None and not row.params.greedy for row in rows):
            temperatures = {row.params.temperature for row in rows}
            if len(temperatures) == 1:  # the common case: nothing per row to copy to the device
                inv_temperature = torch.full((num_rows,), 1.0 / temperatures.pop(), device=device)
                noise = torch.ones(num_rows, device=device)
                seeds = (torch.arange(num_rows, device=device) * _ROW_MIX + step_key) & fused_sampling.SEED_MASK
                return fused_sampling.gumbel_argmax(logits, inv_temperature, noise, seeds)
        inputs = self._row_inputs(rows, step_key)
        scales = upload([*inputs.inv_temperature, *inputs.noise], device, torch.float32).view(2, num_rows)
        seeds = upload(inputs.seeds, device)
        return fused_sampling.gumbel_argmax(logits, scales[0], scales[1], seeds)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        logits = logits.float()
        device = logits.device
        temperatures = {row.params.temperature for row in rows}
        if len(temperatures) == 1:  # one value for the batch (the common case): no tensor to build
            logits = logits / temperatures.pop()
        else:
            temperature = upload([row.params.temperature for row in rows], device, torch.float32)
            logits = logits / temperature.unsqueeze(1)

        top_k = [row.params.top_k for row in rows]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[1]
            k = upload([min(k, vocab) if k > 0 else vocab for k in top_k], device)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, _MASK)

        top_p = [row.params.top_p for row in rows]
        if any(p < 1.0 for p in top_p):
            p = upload(top_p, device, torch.float32)
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= (1.0 - p).unsqueeze(1)
            drop_sorted[:, -1] = False  # always keep the most likely token
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            logits = logits.masked_fill(drop, _MASK)

        probs = logits.softmax(dim=-1)
        min_p = [row.params.min_p for row in rows]
        if any(m > 0.0 for m in min_p):
            m = upload(min_p, device, torch.float32).unsqueeze(1)
            threshold = probs.max(dim=-1, keepdim=True).values * m
            probs = probs.masked_fill(probs < threshold, 0.0)

        noise = torch.empty_like(probs)
        unseeded = [index for index, row in enumerate(rows) if row.params.seed is None]
        if len(unseeded) == len(rows):  # one draw for the whole batch
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise[upload(unseeded, device)] = torch.empty(
                (len(unseeded), probs.shape[1]), device=device
            ).exponential_(generator=self.generator)
        for index, row in enumerate(rows):
            if row.params.seed is not None:
                generator = seeded_generator(row.params.seed, row.num_output_tokens, device)
                noise[index].exponential_(generator=generator)
        return probs.div_(noise).argmax(dim=-1)
