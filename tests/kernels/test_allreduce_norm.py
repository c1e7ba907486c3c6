"""The fused all-reduce + add + RMSNorm kernel against torch, in one process (Triton's interpreter on
the CPU, or one GPU): the peers' buffers are local tensors already holding their partial sums, and
their flags are already set in this rank's signal pad, so the barrier passes at once. The kernel on
two real GPUs, racing its peer: `gpu/test_gpu_allreduce_norm.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_actors.kernels import allreduce_norm  # conftest.py sets TRITON_INTERPRET=1 without CUDA
from vllm_actors.kernels.fused_ops import rms_norm
from vllm_actors.models.fused_all_reduce import (
    FUSED_ENV,
    SLOT_ATTN,
    SLOT_EMBED,
    SLOT_MLP,
    FusedAllReduceNorm,
    fused_from_env,
)
from vllm_actors.models.parallel import TensorParallel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # the interpreter has no bfloat16
pytestmark = pytest.mark.skipif(not allreduce_norm.HAVE_TRITON, reason="needs triton")


class Peers:
    """Every rank's buffer and signal pad, as one process holds them for rank ``rank``."""

    def __init__(self, partials: list[torch.Tensor], rank: int) -> None:
        self.world = len(partials)
        rows, cols = partials[0].shape
        self.programs = allreduce_norm.programs_for(rows)
        self.buffers = [torch.zeros(rows * cols, dtype=partials[0].dtype, device=DEVICE) for _ in partials]
        for peer, part in enumerate(partials):
            if peer != rank:
                self.buffers[peer].copy_(part.reshape(-1))  # what the peer's kernel stored
        self.pads = [torch.zeros(self.programs, self.world, dtype=torch.int32, device=DEVICE) for _ in partials]
        self.pads[rank][:, [p for p in range(self.world) if p != rank]] = 1  # the peers' flags, already sent
        self.buffer_ptrs = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64, device=DEVICE)
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64, device=DEVICE)


def _float64(partials: list[torch.Tensor], weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None) -> torch.Tensor:
    x = sum(p.double() for p in partials)
    assert isinstance(x, torch.Tensor)
    if residual is not None:
        x = x + residual.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("world", "rank", "rows"), [(2, 0, 1), (2, 1, 7), (3, 1, 5), (2, 0, 130)])
def test_sums_every_rank_adds_and_normalises(dtype: torch.dtype, with_residual: bool, world: int, rank: int,
                                             rows: int) -> None:
    """130 rows: more than MAX_PROGRAMS, so programs take several rows each."""
    generator = torch.Generator().manual_seed(world * 100 + rows)
    cols = 96
    partials = [torch.randn((rows, cols), generator=generator).to(dtype).to(DEVICE) for _ in range(world)]
    residual = torch.randn((rows, cols), generator=generator).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(cols, generator=generator)).to(dtype).to(DEVICE)
    peers = Peers(partials, rank)
    out, residual_out = allreduce_norm.all_reduce_rms_norm(partials[rank], peers.buffer_ptrs, peers.pad_ptrs, rank,
                                                           weight, 1e-6, residual)
    want_out, want_residual = allreduce_norm.all_reduce_rms_norm_reference(partials, weight, 1e-6, residual)
    assert torch.equal(residual_out, want_residual)  # the same roundings in the same order
    if dtype == torch.float32:
        want = _float64(partials, weight, 1e-6, residual)
        assert float((out.double() - want).abs().max() / want.abs().max()) < 1e-6
    else:
        assert float((out.float() - want_out.float()).abs().max() / want_out.float().abs().max()) < 1e-2
    # this rank's rows are in its own buffer, for its peers to read
    assert torch.equal(peers.buffers[rank].view(rows, cols), partials[rank])
    # the barrier consumed the peers' flags and left this rank's flag in each peer's pad
    assert int(peers.pads[rank].abs().sum()) == 0
    for peer in range(world):
        if peer != rank:
            assert peers.pads[peer][:, rank].tolist() == [1] * peers.programs
            assert int(peers.pads[peer].sum()) == peers.programs


def test_every_rank_gets_the_same_bits() -> None:
    """Each rank sums in rank order, not its own first: the residual streams of the ranks stay equal."""
    generator = torch.Generator().manual_seed(3)
    partials = [torch.randn((4, 64), generator=generator).to(DEVICE) * 10 ** i for i in range(3)]
    weight = torch.ones(64, device=DEVICE)
    results = []
    for rank in range(3):
        peers = Peers(partials, rank)
        results.append(allreduce_norm.all_reduce_rms_norm(partials[rank], peers.buffer_ptrs, peers.pad_ptrs, rank,
                                                          weight, 1e-6, None))
    for out, residual in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(residual, results[0][1])


def test_bad_shapes_are_refused() -> None:
    x = torch.zeros((2, 8), device=DEVICE)
    peers = Peers([x, x], 0)
    with pytest.raises(ValueError, match="rows, cols"):
        allreduce_norm.all_reduce_rms_norm(x.t(), peers.buffer_ptrs, peers.pad_ptrs, 0, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        allreduce_norm.all_reduce_rms_norm(x, peers.buffer_ptrs, peers.pad_ptrs, 0, torch.ones(8), 1e-6,
                                           torch.zeros((3, 8), device=DEVICE))
    with pytest.raises(ValueError, match="signal pads"):
        allreduce_norm.all_reduce_rms_norm(x, peers.buffer_ptrs, peers.pad_ptrs[:1], 0, torch.ones(8), 1e-6)


def test_off_without_a_gpu_or_when_asked() -> None:
    assert fused_from_env({}, group=None, device=None) is None  # gloo: the all-reduce, then the norm
    cuda = torch.device("cuda", 0)
    assert fused_from_env({FUSED_ENV: "0"}, group=None, device=cuda) is None
    assert fused_from_env({"VLLM_ACTORS_TP_ALLREDUCE": "nccl"}, None, cuda) is None


class _CudaLike:
    """What ``fits`` reads of a CUDA tensor of ``rows`` x ``cols`` with ``size``-byte elements."""

    is_cuda = True

    def __init__(self, rows: int, cols: int, size: int) -> None:
        self.shape, self.size = (rows, cols), size

    def dim(self) -> int:
        return 2

    def stride(self, dim: int) -> int:
        return 1 if dim == 1 else self.shape[1]

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> int:
        return self.size


def test_what_each_kernel_takes() -> None:
    """The flagless kernel needs room for every rank's rows, and 16- or 32-bit elements (EMPTY is
    such a pattern): anything else goes the unfused way instead of failing in the forward pass."""
    fused = object.__new__(FusedAllReduceNorm)  # no symmetric memory: only what fits() reads
    fused.world, fused.max_bytes = 2, 64 * 1024
    for lamport, rows, size, want in [(False, 8, 2, True), (False, 8, 8, True), (False, 9, 8, False),
                                      (True, 4, 2, True), (True, 8, 4, True), (True, 9, 4, False),
                                      (True, 2, 8, False), (True, 2, 1, False)]:
        fused.lamport = lamport
        assert fused.fits(_CudaLike(rows, 1024, size)) is want, (lamport, rows, size)  # type: ignore[arg-type]


class _SlotRecorder(FusedAllReduceNorm):
    """Stands in for the symmetric buffers of rank 0 of two: records each call's slot, and
    normalises this rank's partial as if it were the sum."""

    def __init__(self) -> None:  # no buffers: nothing is exchanged
        self.slots: list[int] = []

    def fits(self, x: torch.Tensor) -> bool:
        return True

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                 slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.slots.append(slot)
        return rms_norm(x, weight, eps, residual)


def test_the_decoder_never_uses_a_slot_twice_in_a_row(tiny_llama_tp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer-reuse rule of the fused all-reduce: consecutive calls, within a forward pass and
    from one step to the next, take different slots (embedding, then attention and MLP per layer)."""
    from tests.support.tiny_models import PagedRunner
    from vllm_actors.models.loader import load_model

    monkeypatch.setattr(TensorParallel, "all_gather_columns", lambda self, x: x)  # no group: rank 0's columns

    recorder = _SlotRecorder()
    tp = TensorParallel(rank=0, size=2, fused=recorder)
    model, _ = load_model(str(tiny_llama_tp), torch.float32, torch.device("cpu"), tp=tp)
    runner = PagedRunner(model, block_size=4, num_blocks=32)
    runner.step({0: [5, 6, 7], 1: [9]})
    runner.step({0: [8], 1: [10]})
    layers = model.config.num_hidden_layers
    one_pass = [SLOT_EMBED] + [SLOT_ATTN, SLOT_MLP] * layers
    assert recorder.slots == one_pass * 2
    assert all(a != b for a, b in zip(recorder.slots, recorder.slots[1:]))


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A slot as the flagless kernel leaves it: every bit set (EMPTY)."""
    return torch.full((numel * torch.finfo(dtype).bits // 8,), 0xFF, dtype=torch.uint8, device=DEVICE).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize(("world", "rank", "rows"), [(2, 0, 1), (2, 1, 7), (3, 2, 5), (2, 0, 130)])
def test_the_flagless_kernel_reads_each_row_as_it_lands_and_empties_the_slot(dtype: torch.dtype, world: int,
                                                                             rank: int, rows: int) -> None:
    """``lamport``: the peers' rows already stored in this rank's slot (their regions), the rest EMPTY.
    The kernel gives the same bits as the flagged one, stores this rank's rows into its region of
    every peer's slot, and leaves its own slot EMPTY for the next call; no signal pad is touched."""
    generator = torch.Generator().manual_seed(world * 10 + rows)
    cols = 96
    partials = [torch.randn((rows, cols), generator=generator).to(dtype).to(DEVICE) for _ in range(world)]
    partials[rank][0, 3] = _empty(1, dtype)[0]  # a NaN with the EMPTY bits: sent as another NaN
    residual = torch.randn((rows, cols), generator=generator).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(cols, generator=generator)).to(dtype).to(DEVICE)
    buffers = [_empty(world * rows * cols, dtype) for _ in range(world)]
    for peer in range(world):
        if peer != rank:
            buffers[rank].view(world, rows, cols)[peer].copy_(partials[peer])
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
    pads = torch.zeros(world, dtype=torch.int64, device=DEVICE)  # unused: any address would do
    out, residual_out = allreduce_norm.all_reduce_rms_norm(partials[rank], buffer_ptrs, pads, rank, weight, 1e-6,
                                                           residual, lamport=True)
    peers = Peers(partials, rank)  # the flagged kernel over the same rows
    want_out, want_residual = allreduce_norm.all_reduce_rms_norm(partials[rank], peers.buffer_ptrs, peers.pad_ptrs,
                                                                 rank, weight, 1e-6, residual)
    assert torch.equal(residual_out.isnan(), want_residual.isnan()) and bool(out[0].isnan().all())  # the norm's row
    assert torch.equal(residual_out[1:], want_residual[1:]) and torch.equal(out[1:], want_out[1:])
    blank = _empty(world * rows * cols, dtype).view(torch.uint8)
    assert torch.equal(buffers[rank].view(torch.uint8), blank)  # EMPTY again
    sent = partials[rank].clone()
    sent.view(torch.uint8).view(-1)[3 * sent.element_size()] = 0xFE  # the low byte: all ones but the last bit
    for peer in range(world):
        if peer != rank:
            got = buffers[peer].view(world, rows, cols)
            assert torch.equal(got[rank].view(torch.uint8), sent.view(torch.uint8))
            others = [r for r in range(world) if r != rank]
            assert all(torch.equal(got[r].contiguous().view(torch.uint8).view(-1),
                                   blank[: rows * cols * sent.element_size()]) for r in others)


@pytest.mark.parametrize("lamport", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("rows", [1, 5])
def test_early_loads_change_no_bit(monkeypatch: pytest.MonkeyPatch, lamport: bool, with_residual: bool,
                                   rows: int) -> None:
    """``VLLM_ACTORS_PDL_EARLY_LOADS``: the residual row and the weight read before the PDL wait
    give the same bits as reading them after it, for both kernels. (Above MAX_PROGRAMS rows, several
    rows a program, the host turns it off.)"""

    world, rank, cols, dtype = 2, 1, 96, HALF
    generator = torch.Generator().manual_seed(rows)
    partials = [torch.randn((rows, cols), generator=generator).to(dtype).to(DEVICE) for _ in range(world)]
    residual = torch.randn((rows, cols), generator=generator).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(cols, generator=generator)).to(dtype).to(DEVICE)

    def reduce() -> tuple[torch.Tensor, torch.Tensor]:
        if not lamport:
            peers = Peers(partials, rank)
            return allreduce_norm.all_reduce_rms_norm(partials[rank], peers.buffer_ptrs, peers.pad_ptrs, rank,
                                                      weight, 1e-6, residual)
        buffers = [_empty(world * rows * cols, dtype) for _ in range(world)]
        buffers[rank].view(world, rows, cols)[0].copy_(partials[0])
        buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)
        pads = torch.zeros(world, dtype=torch.int64, device=DEVICE)
        return allreduce_norm.all_reduce_rms_norm(partials[rank], buffer_ptrs, pads, rank, weight, 1e-6, residual,
                                                  lamport=True)

    monkeypatch.setenv("VLLM_ACTORS_PDL_EARLY_LOADS", "0")
    late = reduce()
    monkeypatch.setenv("VLLM_ACTORS_PDL_EARLY_LOADS", "1")
    early = reduce()
    assert torch.equal(early[0], late[0]) and torch.equal(early[1], late[1])
    want = allreduce_norm.all_reduce_rms_norm_reference(partials, weight, 1e-6, residual)
    assert torch.equal(early[1], want[1])
