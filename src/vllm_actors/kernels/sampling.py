"""Sampling in one pass over the logits: temperature and the Gumbel-max draw fused (Triton).

``Sampler`` draws a token by the exponential race, argmax(p / E) with E ~ Exp(1), which is the
Gumbel-max trick in the log domain: argmax(logits / T - log E) = argmax(logits / T + G) with
G = -log(-log U) ~ Gumbel(0, 1) for U ~ Uniform(0, 1). Both sample exactly from softmax(logits / T).
In torch that costs five passes over batch x vocab float32 (divide, softmax, noise, divide,
argmax: about 0.8 GB at batch 256 and a 152k vocabulary); this kernel reads the logits once and
writes one id per row.

Each program takes one row's slice of 8,192 tokens (a batch of 256 with a 152k vocabulary is
4,864 programs, enough to fill the GPU); a last argmax over the slices' maxima picks the row's token.
Noise comes from Philox (``tl.rand``) keyed per row by a 64-bit seed, and counted by vocabulary
index, so a row's draw depends only on its seed and its logits: never on its place in the batch
or its neighbours. Greedy rows pass ``noise=0`` and get the plain argmax (first index on ties),
so one launch serves a batch that mixes greedy and sampled rows.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False

_BLOCK = 1024
_SPLIT = 8192  # vocabulary slice per program: a 152k vocabulary is 19 programs per row
SEED_MASK = (1 << 63) - 1  # seeds handed to the kernel are non-negative int64


if HAVE_TRITON:

    @triton.jit
    def _uniform(bits):
        """Philox's 32 random bits -> U(0, 1), clamped away from 0 and 1 (G stays finite)."""
        uniform = tl.random.uint_to_uniform_float(bits)
        return tl.minimum(tl.maximum(uniform, 1e-20), 1.0 - 1e-7)

    @triton.jit
    def _update(best, best_index, logits_ptr, row_offset, offsets, bits, inv_temperature, noise, vocab_size):
        inside = offsets < vocab_size
        logits = tl.load(logits_ptr + row_offset + offsets, mask=inside, other=float("-inf"))
        gumbel = -tl.log(-tl.log(_uniform(bits)))
        score = logits.to(tl.float32) * inv_temperature + gumbel * noise
        score = tl.where(inside, score, float("-inf"))
        better = score > best  # strict: each lane keeps its first maximum
        return tl.where(better, score, best), tl.where(better, offsets, best_index)

    @triton.jit
    def _gumbel_argmax_kernel(
        logits_ptr,
        row_stride,
        inv_temperature_ptr,
        noise_ptr,
        seed_ptr,
        best_ptr,
        best_index_ptr,
        vocab_size,
        num_splits,
        SPLIT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program (row, split): the best score and its index within one slice of the vocabulary.
        One Philox call gives four 32-bit draws: lane j of a block's k-th quarter takes draw k of
        counter (block start / 4 + j)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        inv_temperature = tl.load(inv_temperature_ptr + row)
        noise = tl.load(noise_ptr + row)
        seed = tl.load(seed_ptr + row)
        QUARTER: tl.constexpr = BLOCK // 4
        lanes = tl.arange(0, QUARTER)
        row_offset = row.to(tl.int64) * row_stride
        best = tl.full([QUARTER], float("-inf"), tl.float32)
        best_index = tl.full([QUARTER], 2147483647, tl.int32)
        slice_end = tl.minimum(split * SPLIT + SPLIT, vocab_size)
        for start in range(split * SPLIT, slice_end, BLOCK):
            bits0, bits1, bits2, bits3 = tl.randint4x(seed, start // 4 + lanes)
            best, best_index = _update(best, best_index, logits_ptr, row_offset, start + lanes, bits0,
                                       inv_temperature, noise, vocab_size)
            best, best_index = _update(best, best_index, logits_ptr, row_offset, start + QUARTER + lanes, bits1,
                                       inv_temperature, noise, vocab_size)
            best, best_index = _update(best, best_index, logits_ptr, row_offset, start + 2 * QUARTER + lanes, bits2,
                                       inv_temperature, noise, vocab_size)
            best, best_index = _update(best, best_index, logits_ptr, row_offset, start + 3 * QUARTER + lanes, bits3,
                                       inv_temperature, noise, vocab_size)
        top = tl.max(best, axis=0)
        # lowest vocabulary index among the lanes holding the maximum (the argmax's tie rule)
        candidates = tl.where(best == top, best_index, 2147483647)
        tl.store(best_ptr + row * num_splits + split, top)
        tl.store(best_index_ptr + row * num_splits + split, tl.min(candidates, axis=0))

    @triton.jit
    def _philox_uniform_kernel(seed_ptr, out_ptr, vocab_size, BLOCK: tl.constexpr):
        """The uniforms the sampling kernel draws, laid out by vocabulary index (for tests)."""
        row = tl.program_id(0)
        seed = tl.load(seed_ptr + row)
        QUARTER: tl.constexpr = BLOCK // 4
        lanes = tl.arange(0, QUARTER)
        for start in range(0, vocab_size, BLOCK):
            bits0, bits1, bits2, bits3 = tl.randint4x(seed, start // 4 + lanes)
            base = out_ptr + row * vocab_size + start + lanes
            tl.store(base, _uniform(bits0), mask=start + lanes < vocab_size)
            tl.store(base + QUARTER, _uniform(bits1), mask=start + QUARTER + lanes < vocab_size)
            tl.store(base + 2 * QUARTER, _uniform(bits2), mask=start + 2 * QUARTER + lanes < vocab_size)
            tl.store(base + 3 * QUARTER, _uniform(bits3), mask=start + 3 * QUARTER + lanes < vocab_size)


def philox_uniform(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The uniforms ``gumbel_argmax`` draws for each row's seed, [N, V] float32 (for tests)."""
    out = torch.empty((seeds.shape[0], vocab_size), dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _philox_uniform_kernel[(seeds.shape[0],)](seeds, out, vocab_size, BLOCK=_BLOCK)
    return out


def gumbel_from_uniform(uniform: torch.Tensor) -> torch.Tensor:
    """G = -log(-log U) of the (already clamped) uniforms ``philox_uniform`` gives."""
    return -torch.log(-torch.log(uniform.double()))


def gumbel_argmax(
    logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """One token id per row of ``logits`` [N, V]: argmax(logits * inv_temperature + noise * G).

    ``inv_temperature`` and ``noise`` are float32 [N] (noise 1 to sample, 0 for greedy), ``seeds``
    int64 [N] in [0, 2**63), all on the logits' device."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if not rows:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    num_splits = triton.cdiv(vocab, _SPLIT)
    best = torch.empty((rows, num_splits), dtype=torch.float32, device=logits.device)
    best_index = torch.empty((rows, num_splits), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, num_splits)](
        logits, logits.stride(0), inv_temperature, noise, seeds, best, best_index, vocab, num_splits,
        SPLIT=_SPLIT, BLOCK=_BLOCK,
    )
    # the first split holding the row's maximum: the lowest index on ties, as within a split
    winner = best.argmax(dim=1, keepdim=True)
    return best_index.gather(1, winner).squeeze(1).long()


def gumbel_argmax_torch(
    logits: torch.Tensor, inv_temperature: torch.Tensor, noise: torch.Tensor, gumbel: torch.Tensor
) -> torch.Tensor:
    """The same draw in torch (float64), for given Gumbel noise [N, V]: the tests' reference."""
    score = logits.double() * inv_temperature.double().unsqueeze(1) + gumbel.double() * noise.double().unsqueeze(1)
    return score.argmax(dim=-1)
