"""The home's backend and a lender's share as they run on a GPU, checked on the CPU
(``models/kv_borrow.py``): a guest beside a sequence of the home's own, prefilled in chunks and
decoded, on the torch loop and on the GPU kernels (Triton, interpreted here), with the K/V stored by
the backend or before it, as the model's fused write does (``kv_written``): every row equals causal
attention over its whole context, and no guest token lands in the placeholder block its home row
holds where the lenders' blocks sit. A lender's loan: a call waits for it, ``give_back`` waits for a
call being answered, and a call after the loan came back gets an empty share at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from vllm_actors.kernels.attention import TorchPagedAttention, build_attention_metadata, write_kv_cache
from vllm_actors.models import kv_borrow
from vllm_actors.models.kv_borrow import BorrowingAttention, BorrowingMetadata, Guest, LenderShare

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 16


def dense_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last ``len(q)`` positions over ``keys``/``values`` ([S, KV, D]), causal."""
    group = HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.double().transpose(0, 1) @ k.transpose(1, 2)) * scale
    seq_len, num_tokens = keys.shape[0], q.shape[0]
    q_pos = torch.arange(seq_len - num_tokens, seq_len).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > q_pos, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def caches(num_blocks: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator),
            torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator))


@pytest.mark.parametrize(("kernels", "kv_written"), [(False, False), (False, True), (True, True)])
def test_a_guest_beside_a_home_sequence_attends_its_whole_context(kernels: bool, kv_written: bool) -> None:
    from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention

    partials = GpuPartialAttention(decode_splits=2) if kernels else None
    generator = torch.Generator().manual_seed(3)
    home_cache = caches(12, generator)
    placeholder = (home_cache[0][0].clone(), home_cache[1][0].clone())
    shares = [LenderShare([caches(6, generator)], kernels=partials), LenderShare([caches(6, generator)],
                                                                                  kernels=partials)]
    shares[0].lend("long", [4, 1, 5])
    shares[1].lend("long", [2, 0])
    guest = Guest("long", [(shares[0].attend, 3), (shares[1].attend, 2)])
    backend = BorrowingAttention(TorchPagedAttention(), BLOCK, partials)
    free = [9, 3, 11, 6, 1, 8, 2, 10, 5, 4, 7]  # never block 0: the guest row's placeholder
    tables: list[list[int]] = [[0] * 5, []]  # the guest (lent blocks first), a sequence of the home's
    history = [[torch.empty(0, KV_HEADS, DIM)] * 2 for _ in range(2)]
    lens = [0, 0]
    scale = DIM ** -0.5
    for chunks in ((7, 5), (10, 3), (9, 1), (1, 1), (1, 1)):
        query_lens, seq_lens = list(chunks), [lens[i] + chunks[i] for i in range(2)]
        for i in range(2):
            while len(tables[i]) * BLOCK < seq_lens[i]:
                tables[i].append(free.pop())
        q = torch.randn(sum(chunks), HEADS, DIM, generator=generator)
        k = torch.randn(sum(chunks), KV_HEADS, DIM, generator=generator)
        v = torch.randn(sum(chunks), KV_HEADS, DIM, generator=generator)
        backend.begin_step({0: guest})
        meta = backend.prepare(build_attention_metadata(query_lens, seq_lens, tables, BLOCK))
        assert isinstance(meta, BorrowingMetadata)
        in_lent = max(0, min(chunks[0], 5 * BLOCK - lens[0]))  # the guest's tokens in lent blocks
        assert (meta.slot_mapping[:chunks[0]] < 0).tolist() == [True] * in_lent + [False] * (chunks[0] - in_lent)
        if kv_written:  # what the model's fused K/V write does before the backend: every slot but -1
            stored = torch.nonzero(meta.slot_mapping >= 0).flatten()
            write_kv_cache(k[stored], v[stored], *home_cache, meta.slot_mapping[stored])
        out = backend.forward(q, k, v, *home_cache, meta, scale, kv_written=kv_written)
        start = 0
        for i in range(2):
            rows = slice(start, start + chunks[i])
            history[i] = [torch.cat((history[i][0], k[rows])), torch.cat((history[i][1], v[rows]))]
            want = dense_causal(q[rows], history[i][0], history[i][1], scale)
            torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)
            start += chunks[i]
        lens = seq_lens
    assert torch.equal(home_cache[0][0], placeholder[0]) and torch.equal(home_cache[1][0], placeholder[1])
    backend.begin_step({})  # a step without a guest: the inner backend's, unwrapped
    plain = build_attention_metadata([1], [lens[1] + 1], [tables[1] + [free.pop()]], BLOCK)
    assert not isinstance(backend.prepare(plain), BorrowingMetadata)


def test_a_call_waits_for_its_loan_and_a_return_for_the_call_being_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(4)
    share = LenderShare([caches(6, generator)], wait_s=0.2)
    q = torch.randn(2, HEADS, DIM, generator=generator)
    k = torch.randn(2, KV_HEADS, DIM, generator=generator)
    with pytest.raises(LookupError, match="no blocks lent"):
        share.attend(0, "long", 0, q, k, k, 2, 0.25)
    share.lend("long", [3, 1])
    release, entered = threading.Event(), threading.Event()
    real = kv_borrow.run_attention

    def slow(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        entered.set()
        release.wait(10)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kv_borrow, "run_attention", slow)
    answers: list[tuple[torch.Tensor, torch.Tensor]] = []
    call = threading.Thread(target=lambda: answers.append(share.attend(0, "long", 0, q, k, k, 2, 0.25)))
    call.start()
    assert entered.wait(10)
    returned = threading.Thread(target=share.give_back, args=("long",))
    returned.start()
    time.sleep(0.1)
    assert returned.is_alive() and "long" in share.loans  # the call on its blocks is answered first
    release.set()
    call.join(10)
    returned.join(10)
    assert not returned.is_alive() and "long" not in share.loans
    assert answers and not torch.isinf(answers[0][1]).any()
    started = time.monotonic()
    out, lse = share.attend(1, "long", 0, q, k, k, 3, 0.25)  # the home's step of an aborted request, late
    assert time.monotonic() - started < 0.2 and torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all()
    share.lend("long", [2])  # lent again (a resumed copy): answered from its blocks
    assert not torch.isinf(share.attend(0, "long", 0, q, k, k, 2, 0.25)[1]).any()


def test_every_lender_of_a_layer_is_asked_before_any_answer_is_awaited() -> None:
    """The lenders attend at once (and the home's own share in between): each ``PendingShare`` is
    waited for only once every lender has the layer's request."""
    generator = torch.Generator().manual_seed(5)
    events: list[str] = []
    shares = [LenderShare([caches(6, generator)]), LenderShare([caches(6, generator)])]
    shares[0].lend("long", [4, 1])
    shares[1].lend("long", [2])

    class Pending:
        def __init__(self, name: str, answer: tuple[torch.Tensor, torch.Tensor]) -> None:
            self.name, self.answer = name, answer

        def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
            events.append(f"wait {self.name}")
            return self.answer

    def asking(name: str, share: LenderShare) -> kv_borrow.LendCall:
        def call(*args: object) -> Pending:
            events.append(f"ask {name}")
            return Pending(name, share.attend(*args))  # type: ignore[arg-type]
        return call

    backend = BorrowingAttention(TorchPagedAttention(), BLOCK)
    backend.begin_step({0: Guest("long", [(asking("a", shares[0]), 2), (asking("b", shares[1]), 1)])})
    meta = backend.prepare(build_attention_metadata([13], [13], [[0, 0, 0, 5]], BLOCK))
    q = torch.randn(13, HEADS, DIM, generator=generator)
    k, v = torch.randn(2, 13, KV_HEADS, DIM, generator=generator)
    out = backend.forward(q, k, v, *caches(6, generator), meta, DIM ** -0.5)
    assert events == ["ask a", "ask b", "wait a", "wait b"]
    torch.testing.assert_close(out.double(), dense_causal(q, k, v, DIM ** -0.5), rtol=1e-5, atol=1e-5)
