"""A long prefill chunk over an fp8 KV cache through flash-attn 4 on Hopper, by a bf16 staging of its context.

flash-attn 4 takes fp8 K/V only on SM100, so on SM90 an fp8 cache would leave every prefill to the
Triton varlen kernel. For a step whose attention has ONE sequence (a long prompt's chunk, no decode
rows) and a chunk long enough for flash-attn (``prefill_choice``), the context [0, seq_len) is cut
into pieces of at most ``stage`` keys (``STAGE``, or ``max_num_batched_tokens`` when larger, so that
the last piece holds the whole chunk):

* the last piece [max(0, seq_len - stage), seq_len) holds every query; it is attended with
  ``causal=True``, which flash-attn aligns bottom-right (the queries are its last q_len positions);
* every earlier piece lies wholly before the chunk's first query and is attended non-causally.

Each piece is dequantized (``dequant_gather``: K = fp8 * k_scale, V = fp8 * v_scale, in the query's
dtype, as the Triton kernels read the cache) through the sequence's block table into one staging
pair [stage, num_kv_heads, head_dim] that every piece and layer reuses, attended by
``flash_attn_varlen_func`` over contiguous K/V with its log-sum-exp, and the pieces merge exactly by
their LSEs (``merge_piece``, into a float32 accumulator; the last merge writes the query's dtype).

The buffers are allocated once per runner, before the KV pool is sized (``runner/fp8_staging.py``).
The number of pieces depends on seq_len (a host integer), so such steps run eagerly (the runner keeps
them out of the padded CUDA graphs; a step being captured never takes this path).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill, takes_layer_options
from vllm_actors.kernels.prefill_choice import prefill_kernel

STAGE = 32768  # keys per piece (at least max_num_batched_tokens): 64 MiB of bf16 K+V at 8 KV heads of 64


@triton.jit
def _dequant_gather_kernel(
    k_cache, v_cache, table, k_out, v_out, k_scale, v_scale,
    start, count, block_size,
    c_block, c_slot, c_head,  # the caches' strides (elements; head_dim's is 1)
    o_tok, o_head,  # the staging buffers' strides
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Keys [start, start + count) of one sequence, one KV head (program axis 1), BLOCK_T at a time."""
    head = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    rows = t < count
    pos = start + t
    block = tl.load(table + pos // block_size, mask=rows, other=0).to(tl.int64)
    src = (block * c_block + (pos % block_size) * c_slot + head * c_head)[:, None] + d[None, :]
    dst = (t.to(tl.int64) * o_tok + head * o_head)[:, None] + d[None, :]
    mask = rows[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_cache + src, mask=mask, other=0.0).to(tl.float32) * tl.load(k_scale)
    tl.store(k_out + dst, k.to(k_out.dtype.element_ty), mask=mask)
    v = tl.load(v_cache + src, mask=mask, other=0.0).to(tl.float32) * tl.load(v_scale)
    tl.store(v_out + dst, v.to(v_out.dtype.element_ty), mask=mask)


def dequant_gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, start: int, count: int,
    k_scale: torch.Tensor, v_scale: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
) -> None:  # fmt: skip
    """Keys [start, start + count) of the sequence whose block table is ``table`` (int32 [max_blocks]),
    dequantized into rows [0, count) of ``k_out``/``v_out`` ([>= count, num_kv_heads, head_dim])."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"the caches need one layout with a unit last stride, got {k_cache.stride()} and "
                         f"{v_cache.stride()}")
    if k_out.shape[0] < count or k_out.shape[1:] != k_cache.shape[2:] or v_out.stride() != k_out.stride() \
            or k_out.stride(-1) != 1:
        raise ValueError(f"staging {tuple(k_out.shape)} cannot take {count} keys of {tuple(k_cache.shape[2:])}")
    if count <= 0:
        return
    block_t = 64
    grid = (triton.cdiv(count, block_t), num_kv_heads)
    _dequant_gather_kernel[grid](
        k_cache, v_cache, table, k_out, v_out, k_scale, v_scale, start, count, block_size,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_out.stride(0), k_out.stride(1),
        HEAD_DIM=head_dim, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


@triton.jit
def _merge_kernel(
    acc, acc_lse, part, part_lse, out, rows, num_heads,
    a_tok, a_head, p_tok, p_head, l_head, l_tok, o_tok, o_head,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr,
):  # fmt: skip
    """One piece's (output, lse) into the running (acc, acc_lse); rows are (token, head) pairs."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = r < rows
    t = (r // num_heads).to(tl.int64)
    h = r % num_heads
    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    o = tl.load(part + (t * p_tok + h * p_head)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(part_lse + h * l_head + t * l_tok, mask=valid, other=float("-inf"))
    acc_at = (t * a_tok + h * a_head)[:, None] + d[None, :]
    if FIRST:
        merged = o
        lse = b
    else:
        a = tl.load(acc_lse + r, mask=valid, other=float("-inf"))
        m = tl.maximum(a, b)
        m = tl.where(m == float("-inf"), 0.0, m)  # no key on either side: weights 0
        wa = tl.exp(a - m)
        wb = tl.exp(b - m)
        total = wa + wb
        seen = total > 0
        safe = tl.where(seen, total, 1.0)
        prior = tl.load(acc + acc_at, mask=mask, other=0.0)
        merged = (prior * wa[:, None] + o * wb[:, None]) * tl.where(seen, 1.0 / safe, 0.0)[:, None]
        lse = tl.where(seen, m + tl.log(safe), float("-inf"))
    if LAST:
        tl.store(out + (t * o_tok + h * o_head)[:, None] + d[None, :], merged.to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(acc + acc_at, merged, mask=mask)
        tl.store(acc_lse + r, lse, mask=valid)


def merge_piece(
    acc: torch.Tensor, acc_lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
    first: bool, last: bool,
) -> None:  # fmt: skip
    """Merge a piece's output ``part`` [T, H, D] and ``part_lse`` [H, T] (flash-attn's varlen layout)
    into ``acc`` [>= T, H, D] float32 and ``acc_lse`` [>= T * H] float32; ``last`` writes the merged
    result into ``out`` [T, H, D] (any dtype) instead of the accumulator."""
    num_tokens, num_heads, head_dim = part.shape
    if part_lse.shape != (num_heads, num_tokens):
        raise ValueError(f"a piece's lse must be [num_heads, num_tokens] = {(num_heads, num_tokens)}, "
                         f"got {tuple(part_lse.shape)}")
    block_d = triton.next_power_of_2(head_dim)
    block_r = max(1, 4096 // block_d)
    rows = num_tokens * num_heads
    _merge_kernel[(triton.cdiv(rows, block_r),)](
        acc, acc_lse, part, part_lse, out, rows, num_heads,
        acc.stride(0), acc.stride(1), part.stride(0), part.stride(1), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_D=block_d, FIRST=first, LAST=last,
    )  # fmt: skip


def plan_pieces(seq_len: int, query_len: int, stage: int) -> list[tuple[int, int, bool]]:
    """The pieces (start, end, causal) of a context of ``seq_len`` keys whose last ``query_len`` are the
    chunk: earlier pieces of ``stage`` keys from 0, then the causal last piece of the last ``stage``."""
    if not 0 < query_len <= min(seq_len, stage):
        raise ValueError(f"a staged chunk needs 0 < query_len ({query_len}) <= min(seq_len ({seq_len}), "
                         f"stage ({stage}))")
    last = max(0, seq_len - stage)
    pieces = [(start, min(start + stage, last), False) for start in range(0, last, stage)]
    return [*pieces, (last, seq_len, True)]


class Fp8PrefillStaging:
    """The staged path of one runner: its buffers, the rule (``takes_step``, ``wants``) and the
    attention (calling it). ``prefill``: the backend's flash-attn path (its choice and function)."""

    def __init__(self, prefill: FlashAttnPrefill, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_num_tokens: int, stage: int | None = None) -> None:
        self.prefill = prefill
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.max_num_tokens = max_num_tokens
        self.stage = max(STAGE if stage is None else stage, max_num_tokens)
        self.k_stage = torch.empty((self.stage, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.v_stage = torch.empty_like(self.k_stage)
        self.acc = torch.empty((max_num_tokens, num_heads, head_dim), dtype=torch.float32, device=device)
        self.acc_lse = torch.empty(max_num_tokens * num_heads, dtype=torch.float32, device=device)
        self._bounds: dict[int, torch.Tensor] = {}  # n -> int32 [0, n] on the device (cu_seqlens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_stage, self.v_stage, self.acc, self.acc_lse))

    def takes_step(self, num_seqs: int, max_query_len: int) -> bool:
        """Whether a step of ``num_seqs`` sequences whose longest query is ``max_query_len`` goes here."""
        return num_seqs == 1 and max_query_len <= self.stage \
            and prefill_kernel(self.prefill.choice, True, max_query_len, self.head_dim) == "flash_attn"

    def wants(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
              sliding_window: int | None = None, logits_soft_cap: float | None = None) -> bool:
        """Whether this layer of this step goes here: an fp8 cache, no window, the staging's shapes, the
        step's host fields true to it (one sequence, all of q), not under CUDA graph capture."""
        if not kv_quant.is_fp8(k_cache.dtype) or sliding_window is not None:
            return False
        if logits_soft_cap is not None and not takes_layer_options(self.prefill.function()):
            return False
        if q.dtype != self.dtype or tuple(q.shape[1:]) != (self.num_heads, self.head_dim) \
                or tuple(k_cache.shape[2:]) != (self.num_kv_heads, self.head_dim):
            return False
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        if meta.num_seqs != 1 or meta.query_lens_cpu[0] != q.shape[0] or meta.max_query_len != q.shape[0] \
                or meta.seq_lens_cpu[0] != meta.max_seq_len:
            return False
        return self.takes_step(1, q.shape[0])

    def _bound(self, n: int, device: torch.device) -> torch.Tensor:
        if n not in self._bounds:
            if len(self._bounds) > 16:
                self._bounds.clear()
            self._bounds[n] = torch.tensor([0, n], dtype=torch.int32).to(device, non_blocking=True)
        return self._bounds[n]

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 logits_soft_cap: float | None = None) -> torch.Tensor:
        """Causal attention of the step's one sequence over its fp8 context: [T, num_heads, head_dim]."""
        q_len, seq_len = q.shape[0], meta.seq_lens_cpu[0]
        k_scale = kv_quant.checked_scale(k_scale, k_cache)
        v_scale = kv_quant.checked_scale(v_scale, v_cache)
        table = meta.block_tables[0]
        pieces = plan_pieces(seq_len, q_len, self.stage)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for index, (start, end, causal) in enumerate(pieces):
            count = end - start
            dequant_gather(k_cache, v_cache, table, start, count, k_scale, v_scale, self.k_stage, self.v_stage)
            arguments: dict[str, Any] = {
                "q": q, "k": self.k_stage[:count], "v": self.v_stage[:count],
                "cu_seqlens_q": self._bound(q_len, q.device), "cu_seqlens_k": self._bound(count, q.device),
                "softmax_scale": scale, "causal": causal, "return_lse": True,
            }  # fmt: skip
            if logits_soft_cap is not None:
                arguments["softcap"] = logits_soft_cap
            part, part_lse = self.prefill.caller()(**arguments)
            if len(pieces) == 1:
                return part
            merge_piece(self.acc, self.acc_lse, part, part_lse, out, index == 0, index == len(pieces) - 1)
        return out
