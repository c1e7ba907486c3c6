"""Paged attention interface and its torch reference implementation.

Layout: per layer, `k_cache` and `v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`,
in the model's dtype or in fp8 with the layer's `k_scale` and `v_scale` (`kv_quant.py`).
A batch step carries the new tokens of B sequences flattened to T tokens (no padding). Each
sequence's new queries are the last `query_len` positions of its `seq_len` context and attend
causally to its whole context, read through its block table. Kernels know nothing of actors.

Two per-layer options (Mistral, Gemma 2/3): ``sliding_window`` W limits the query at position p
to keys at positions above p - W (Hugging Face's rule: the W most recent tokens, itself included),
and ``logits_soft_cap`` c replaces each scaled score s by c * tanh(s / c) before the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import structlog
import torch
import torch.nn.functional as F

from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.choice import kernel_choice, use_triton

log = structlog.get_logger(__name__)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [B+1] int32: cumulative query lengths (tokens this step per sequence)
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, used by the torch reference
    seq_lens_cpu: list[int]
    # [B] int64, longest context first: the order in which a decode kernel takes the sequences.
    # Filled by the backend's `prepare`, once a step before the first layer (inside a CUDA graph
    # when the step is captured in one).
    decode_order: torch.Tensor | None = None
    # [2, B] int32 (decode steps): each sequence's query group, its first and end sequence: consecutive
    # decode rows of one sequence's consecutive positions (a verification step's), which a backend may
    # attend together (`triton_decode`); None, or first = i and end = i + 1: every sequence alone.
    decode_groups: torch.Tensor | None = None
    # keys cached before the longest query (its sequence's context before this step), and the other
    # sequences' keys together: None until asked
    longest_query_context: int | None = None
    keys_beside_longest: int | None = None
    step_keys: int | None = None  # every sequence's keys together: None until asked
    # flash-attn 4's split of the longest query over its keys (``flash_attn_split``): (plan or None,
    # its device tensors), planned at the step's first layer that asks
    flash_splits: tuple[Any, Any] | None = None

    def context_of_longest_query(self) -> int:
        """Keys cached before the step's longest query; one pass over the host lists, kept for the
        step's other layers."""
        if self.longest_query_context is None:
            longest, context, length = 0, 0, 0
            for query_len, seq_len in zip(self.query_lens_cpu, self.seq_lens_cpu, strict=True):
                if query_len > longest:
                    longest, context, length = query_len, seq_len - query_len, seq_len
            self.longest_query_context = context
            self.keys_beside_longest = self.keys_in_step() - length
        return self.longest_query_context

    def keys_in_step(self) -> int:
        """Every sequence's keys together (the host's lengths), summed once for the step's layers."""
        if self.step_keys is None:
            self.step_keys = sum(self.seq_lens_cpu)
        return self.step_keys

    def keys_beside_longest_query(self) -> int:
        """The keys of every sequence of the step but the longest query's, together."""
        self.context_of_longest_query()
        assert self.keys_beside_longest is not None
        return self.keys_beside_longest

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for a batch whose sequence i adds query_lens[i] tokens, reaching seq_lens[i] in all.

    block_tables[i] lists the cache blocks of sequence i in order (at least ceil(seq_lens[i] / block_size)).
    """
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
        if not 0 <= q_len <= s_len:
            raise ValueError(f"query_len {q_len} must be within [0, seq_len {s_len}]")
        if len(table) * block_size < s_len:
            raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {s_len} tokens")
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len))
    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), max_blocks),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )


class AttentionBackend(Protocol):
    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Per-step work every layer shares (e.g. the decode order), done once before the first
        layer; inside the step's CUDA graph when it is captured in one."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write k/v at meta.slot_mapping (unless the caller did: kv_written), then return the
        attention output [T, num_heads, head_dim]. k_scale, v_scale: the layer's scales (float32,
        one element), needed by an fp8 cache and ignored by others. sliding_window,
        logits_soft_cap: the layer's options (module docstring); None: off."""
        ...


def check_attention_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """A ValueError for a window below 1 or a soft cap that is not positive."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap}")


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v ([T, num_kv_heads, head_dim]) into the paged caches at the flat slots of
    slot_mapping; into an fp8 cache quantised by k_scale and v_scale."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for x, cache, x_scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        if kv_quant.is_fp8(cache.dtype):
            stored = kv_quant.quantize(x, kv_quant.checked_scale(x_scale, cache), cache.dtype)
            # index_copy_ has no fp8 kernel on the CPU: copy the bytes
            flat.view(torch.uint8).index_copy_(0, slot_mapping, stored.view(torch.uint8))
        else:
            flat.index_copy_(0, slot_mapping, x.to(cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Contiguous [seq_len, num_kv_heads, head_dim] context of one sequence read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


class TorchPagedAttention:
    """Reference backend: a Python loop over sequences with an explicit causal-with-offset mask.
    An fp8 cache is read back to float32 (times its scale) and attended in float32."""

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        check_attention_options(sliding_window, logits_soft_cap)
        if not kv_written:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        num_heads = q.shape[1]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        fp8_scales = None
        if kv_quant.is_fp8(k_cache.dtype):
            fp8_scales = kv_quant.checked_scale(k_scale, k_cache), kv_quant.checked_scale(v_scale, v_cache)
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 0:
                continue
            qi = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
            ki = gather_kv(k_cache, meta.block_tables[i], seq_len)
            vi = gather_kv(v_cache, meta.block_tables[i], seq_len)
            if fp8_scales is not None:
                qi = qi.float()
                ki, vi = kv_quant.dequantize(ki, fp8_scales[0]), kv_quant.dequantize(vi, fp8_scales[1])
            else:
                ki, vi = ki.to(q.dtype), vi.to(q.dtype)
            ki = ki.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, seq_len, D]
            vi = vi.transpose(0, 1).repeat_interleave(group, dim=0)
            # query j sits at absolute position seq_len - q_len + j and sees keys 0..that position
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos  # [q_len, seq_len], True = attend
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            if logits_soft_cap is None:
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            else:
                # no soft-capping in SDPA: explicit math, in float32 at least
                wide = torch.promote_types(qi.dtype, torch.float32)
                raw = (qi.to(wide) @ ki.to(wide).transpose(1, 2)) * scale
                scores = (logits_soft_cap * torch.tanh(raw / logits_soft_cap)).masked_fill(~mask, float("-inf"))
                oi = torch.softmax(scores, dim=-1) @ vi.to(wide)
            out[start : start + q_len] = oi.transpose(0, 1).to(q.dtype)
            start += q_len
        return out


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """Attention backend for device: the Triton kernels on CUDA when triton imports, else the torch
    reference. The environment variable VLLM_ACTORS_ATTENTION=torch|triton overrides the choice
    (triton on a CPU device needs TRITON_INTERPRET=1, set before triton is first imported). The
    Triton backend attends prefills through flash-attn 4 where VLLM_ACTORS_PREFILL_ATTENTION and the
    device allow (``kernels/flash_attn_prefill.py``)."""
    if not use_triton("VLLM_ACTORS_ATTENTION", True, torch.device(device)):  # triton's import is tried below
        return TorchPagedAttention()
    try:
        from vllm_actors.kernels.triton_attention import TritonPagedAttention
    except ImportError as exc:
        if kernel_choice("VLLM_ACTORS_ATTENTION") == "triton":
            raise
        log.warning("triton_unavailable_using_torch_attention", error=str(exc))
        return TorchPagedAttention()
    from vllm_actors.kernels.flash_attn_prefill import flash_attn_prefill_for

    return TritonPagedAttention(prefill=flash_attn_prefill_for(torch.device(device)))


def flash_attn_tile_m(head_dim: int) -> int:
    """Query rows one CTA of flash-attn 4's SM90 forward attends over the whole context (a query
    head's tokens, or with packed GQA a KV head's group of them): ``_tile_size_fwd_sm90`` of its
    ``cute/interface.py``, 192 up to head_dim 96 and 128 above. A step's CTAs run in waves of one per SM."""
    return 192 if head_dim <= 96 else 128


def attention_wave_tokens(backend: object, device: torch.device, num_heads: int, head_dim: int) -> int:
    """Tokens of one sequence's chunk that make one whole wave of flash-attn 4's CTAs on ``device``
    (``num_heads``: this rank's query heads); 0 where prefills do not go to flash-attn 4. A chunk
    just past a whole number of waves runs a nearly empty last one: at 120k keys on an H200 a chunk
    of 1,152 tokens took 1.37x the time of 1,024 (3 waves against 2)."""
    if getattr(backend, "prefill", None) is None or device.type != "cuda" or num_heads < 1:
        return 0
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return sms * flash_attn_tile_m(head_dim) // num_heads


def describe_attention(backend: object) -> str:
    """What attends a step, for the worker's readiness report: ``torch``, ``triton``, or
    ``triton+flash_attn(<choice>)`` where prefills may go to flash-attn 4; another backend's ``name``."""
    prefill = getattr(backend, "prefill", None)
    name = getattr(backend, "name", None)
    if isinstance(name, str):
        return name
    if isinstance(backend, TorchPagedAttention):
        return "torch"
    if prefill is None:
        return "triton"
    return f"triton+flash_attn({prefill.choice})"

