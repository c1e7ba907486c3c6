"""flash-attn 4's calls replayed past its interface (``kernels/flash_attn_replay.py``), on a stand-in for
``flash_attn.cute.interface``: a varlen function that allocates the output and LSE, looks its kernel up in
``_flash_attn_fwd.compile_cache`` and calls it with an argument list like flash-attn's SM90 one, the kernel
being the torch model of the documented semantics. The real kernel: tests/gpu/test_gpu_flash_attn_prefill.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.support.paged_batch import flash_attn_varlen_model, paged_batch
from vllm_actors.kernels.flash_attn_prefill import varlen_arguments
from vllm_actors.kernels.flash_attn_replay import FlashAttnReplay


class Interface:
    """``flash_attn.cute.interface`` in miniature. ``per_call``: metadata it computes for each call (a tensor
    the kernel takes, as flash-attn's above its batch threshold); ``sized``: an argument derived from the
    sizes (q rows), which a replay must not freeze."""

    BIN_BATCH_SEARCH_THRESH = 8

    def __init__(self, per_call: bool = False, sized: bool = False) -> None:
        self._flash_attn_fwd = SimpleNamespace(compile_cache={})
        self.per_call, self.sized = per_call, sized
        self.interface_calls = self.kernel_calls = 0

    def varlen(self, **kw: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.interface_calls += 1
        q = kw["q"] if kw["q"].is_contiguous() else kw["q"].contiguous()  # flash-attn's maybe_contiguous
        out = torch.empty(q.shape[0], q.shape[1], kw["v"].shape[-1], dtype=q.dtype)
        lse = torch.empty(q.shape[1], q.shape[0]) if kw.get("return_lse") else None
        key = (q.dtype, kw["causal"], lse is None)
        cache = self._flash_attn_fwd.compile_cache
        if key not in cache:
            cache[key] = self.kernel
        extra = torch.zeros(2) if self.per_call else None
        cache[key](q.detach(), kw["k"], kw["v"], out.detach(), lse, kw["softmax_scale"], kw["cu_seqlens_q"], None,
                   None, kw["seqused_k"], kw["page_table"], None, None, None, None, ("aux", None), extra,
                   q.shape[0] if self.sized else 0, kw["causal"])
        return out, lse

    def kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
               scale: float, cu: torch.Tensor, _cu_k: None, _used_q: None, used: torch.Tensor, table: torch.Tensor,
               *rest: Any) -> None:
        self.kernel_calls += 1
        assert rest[-2] in (0, q.shape[0])  # a sized argument replayed stale would show here
        o, lse_model = flash_attn_varlen_model(q=q, k=k, v=v, cu_seqlens_q=cu, seqused_k=used, page_table=table,
                                               softmax_scale=scale, causal=rest[-1], return_lse=True)
        out.copy_(o)
        if lse is not None:
            assert lse_model is not None
            lse.copy_(lse_model)


def _arguments(specs: list[tuple[int, int]], seed: int, return_lse: bool = True) -> dict[str, Any]:
    batch = paged_batch(specs, 4, 4, 2, 16, torch.float32, seed=seed)
    batch.write_new_tokens()
    arguments = varlen_arguments(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    return {**arguments, "return_lse": return_lse}


def _model(arguments: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return flash_attn_varlen_model(**arguments)


def test_a_kind_is_replayed_after_two_sizes_agree_and_matches_the_interface() -> None:
    interface = Interface()
    replay = FlashAttnReplay(interface.varlen, interface)
    calls = [_arguments([(30, 5), (7, 1)], seed=1), _arguments([(30, 5), (7, 1)], seed=2),
             _arguments([(50, 9), (3, 1), (12, 1)], seed=3), _arguments([(61, 2)], seed=4),
             _arguments([(20, 16), (5, 1), (9, 1), (40, 1)], seed=5)]
    for arguments in calls:
        out, lse = replay(**arguments)
        want_out, want_lse = _model(arguments)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        assert lse is not None and want_lse is not None
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    # the first two are one size (recorded, unconfirmed), the third another (confirmed): the last two replay
    assert interface.interface_calls == 3 and interface.kernel_calls == 5
    assert len(replay.replays) == 1 and next(iter(replay.replays.values())) is not None
    # another kind (no LSE asked) records on its own; the replay answers None for the LSE then
    for seed, specs in enumerate(([(30, 5)], [(9, 3), (4, 1)], [(17, 2)])):
        out, lse = replay(**_arguments(specs, seed=10 + seed, return_lse=False))
        assert lse is None
    assert interface.interface_calls == 5 and len(replay.replays) == 2


def test_calls_with_metadata_of_their_own_or_sized_arguments_stay_on_the_interface() -> None:
    for interface in (Interface(per_call=True), Interface(sized=True)):
        replay = FlashAttnReplay(interface.varlen, interface)
        for seed, specs in enumerate(([(30, 5)], [(9, 3), (4, 1)], [(17, 2)], [(8, 1)])):
            arguments = _arguments(specs, seed=seed)
            out, _ = replay(**arguments)
            torch.testing.assert_close(out, _model(arguments)[0], rtol=1e-5, atol=1e-5)
        assert interface.interface_calls == 4
        assert list(replay.replays.values()) == [None]


def test_batches_over_the_threshold_and_unknown_arguments_are_never_replayed() -> None:
    interface = Interface()
    replay = FlashAttnReplay(interface.varlen, interface)
    big = [(6, 1)] * (Interface.BIN_BATCH_SEARCH_THRESH + 1)
    for seed in range(3):
        replay(**_arguments(big, seed=seed))
    assert replay.kind(_arguments(big, seed=0)) is None and interface.interface_calls == 3
    assert replay.kind({**_arguments([(6, 1)], seed=0), "learnable_sink": None}) is None
    # an interface without the compile cache: every call through it
    bare = Interface()
    del bare._flash_attn_fwd.compile_cache
    plain = FlashAttnReplay(lambda **kw: _model(kw), bare)
    for seed in range(3):
        plain(**_arguments([(9, 2)], seed=seed))
    assert list(plain.replays.values()) == [None]


def test_a_query_viewed_from_the_fused_qkv_is_passed_contiguous_and_replayed() -> None:
    """The engine's q is a view into the QKV projection's output; flash-attn would copy it on every call (a
    tensor of its own: that kind never replays). ``varlen_arguments`` passes the copy instead."""
    interface = Interface()
    replay = FlashAttnReplay(interface.varlen, interface)
    for seed, specs in enumerate(([(30, 5)], [(9, 3), (4, 1)], [(17, 2)])):
        batch = paged_batch(specs, 4, 4, 2, 16, torch.float32, seed=seed)
        batch.write_new_tokens()
        qkv = torch.cat([batch.q.flatten(1), torch.zeros(batch.q.shape[0], 16)], dim=1)
        view = qkv[:, : batch.q[0].numel()].view_as(batch.q)
        assert not view.is_contiguous()
        arguments = {**varlen_arguments(view, batch.k_cache, batch.v_cache, batch.meta, batch.scale),
                     "return_lse": True}
        assert arguments["q"].is_contiguous()
        out, _ = replay(**arguments)
        torch.testing.assert_close(out, _model(arguments)[0], rtol=1e-5, atol=1e-5)
    assert interface.interface_calls == 2 and [r is not None for r in replay.replays.values()] == [True]
    # the view itself, as before: flash-attn's own copy is a tensor the replay cannot name
    refused = FlashAttnReplay(interface.varlen, interface)
    for seed, specs in enumerate(([(30, 5)], [(9, 3), (4, 1)])):
        batch = paged_batch(specs, 4, 4, 2, 16, torch.float32, seed=seed)
        view = torch.cat([batch.q.flatten(1), torch.zeros(batch.q.shape[0], 16)], dim=1)[:, :64].view_as(batch.q)
        refused(**{**varlen_arguments(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale), "q": view})
    assert list(refused.replays.values()) == [None]
