"""Prefill attention through flash-attn 4's varlen forward (``flash_attn.cute``, CuTe DSL, JIT-compiled)
on Hopper, over the paged cache as it is.

The engine's metadata maps one to one onto the kernel's arguments: q packed by ``query_start_loc``
(``cu_seqlens_q``), the context lengths ``seq_lens`` (``seqused_k``), the block tables
(``page_table``) over the caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` as pages, and
``causal=True``, which flash-attn aligns bottom-right (query i of a sequence with q_len queries over
k_len keys sees keys up to k_len - q_len + i), as the engine's contract puts the queries at the end
of their context. GQA is native (query head h reads KV head h // group).

What it needs, read from flash-attn-4 4.0.0b36's ``interface.py`` and ``flash_fwd_sm90.py``:

* q and the caches of one dtype, float16 or bfloat16 (float8 K/V only on SM100: an fp8 cache stays
  on Triton here);
* head_dim a multiple of 16 up to 256 (its interface takes multiples of 8, but pages loaded by
  cp.async must fill the padded head dim); num_heads a multiple of num_kv_heads; int32 metadata;
* any block size: a page of exactly the kernel's key tile (128 at head_dim 64 and 128) loads by TMA,
  any other size by cp.async through the page table (``paged_kv_non_tma``). With TMA a tile loads the
  whole last page of a sequence, so unused rows of a sequence's last page must be finite (the pool is
  zero-filled and only ever holds K/V values);
* no split-KV on SM90 (decode stays on the Triton decode kernel): a short chunk over a long context is
  split over its keys here instead (``flash_attn_split``, ``VLLM_ACTORS_FLASH_ATTN_SPLIT_KEYS``);
* grouped query heads share a tile per KV head by default (``pack_gqa``; flash-attn 3 packs long
  prefills only where pages are not TMA-loaded): ``VLLM_ACTORS_FLASH_ATTN_PACK_GQA`` turns it on or off;
* a layer's sliding window and soft cap go to its ``window_size=(window - 1, 0)`` and ``softcap``
  arguments; a ``flash_attn_varlen_func`` whose signature lacks them leaves such layers to Triton.

Nothing here syncs with the host or sizes anything from tensor values: a step using it can be
captured in a CUDA graph (flash-attn compiles on the first call of each kernel variant, outside it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import structlog
import torch

from vllm_actors.envs import envs
from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.kernels.flash_attn_replay import FlashAttnReplay
from vllm_actors.kernels.flash_attn_split import KeySplits, KeySplitTensors, merge_into, plan_key_splits, split_tensors
from vllm_actors.kernels.prefill_choice import PrefillKernel, prefill_choice, prefill_kernel

log = structlog.get_logger(__name__)

FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
PACK_GQA_CHOICES = ("auto", "on", "off")
VarlenFunc = Callable[..., Any]  # flash_attn.cute.flash_attn_varlen_func


@functools.cache
def _unavailable_on(device_index: int) -> str | None:
    """Why flash-attn 4 cannot run on CUDA device ``device_index``; None when it can."""
    major, minor = torch.cuda.get_device_capability(device_index)
    if major != 9:
        return f"the device is sm{major}{minor}, not Hopper (sm90)"
    try:
        import flash_attn.cute  # noqa: F401  # imported only where it can run: it pulls in the CuTe DSL
    except Exception as exc:  # an installed but broken kit is as good as none: Triton serves
        return f"flash_attn.cute does not import ({type(exc).__name__}: {exc})"
    return None


def flash_attn_unavailable(device: torch.device) -> str | None:
    """Why flash-attn 4 cannot run on ``device`` (not CUDA, not Hopper, not installed); None when it can."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the device is {device.type}, not a CUDA GPU"
    return _unavailable_on(device.index if device.index is not None else torch.cuda.current_device())


def layout_problem(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """Why flash-attn 4 cannot take these operands (host shapes and dtypes only); None when it can."""
    head_dim = q.shape[-1]
    if q.dtype not in FLASH_ATTN_DTYPES:
        return f"q is {q.dtype}, flash-attn takes float16 or bfloat16"
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return f"the cache is {k_cache.dtype}, q is {q.dtype}"
    if head_dim % 16 or not 16 <= head_dim <= 256 or k_cache.shape[-1] != head_dim:
        return f"head_dim {head_dim} (cache {k_cache.shape[-1]}): flash-attn takes a multiple of 16 up to 256"
    if q.shape[1] % k_cache.shape[2]:
        return f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {k_cache.shape[2]}"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        return "q and the caches need a unit last stride"
    return None


def _int32(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous int32 (no copy when it already is)."""
    return t.to(torch.int32).contiguous()


def varlen_arguments(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    pack_gqa: str = "auto",
) -> dict[str, Any]:
    """The keyword arguments of ``flash_attn_varlen_func`` for one step over the paged cache
    (``pack_gqa``: ``auto``, ``on`` or ``off``, ``pack_gqa_argument``).

    No ``max_seqlen_q``/``max_seqlen_k``: flash-attn then bounds them by the q rows and the page-table
    width, so one compiled variant serves every batch (a host hint of the longest query would pick
    another variant for steps of short queries, compiled mid-serving).
    """
    arguments: dict[str, Any] = {
        # q is a view into the fused QKV output: flash-attn copies such a q itself on every call, and a copy made
        # here is the q its compiled kernel is then called with (``flash_attn_replay`` matches it)
        "q": q.contiguous(),
        "k": k_cache,
        "v": v_cache,
        "cu_seqlens_q": _int32(meta.query_start_loc),
        "seqused_k": _int32(meta.seq_lens),
        "page_table": _int32(meta.block_tables),
        "softmax_scale": scale,
        "causal": True,
    }
    if sliding_window is not None:  # keys [p - (window - 1), p]: the window's keys, p included
        arguments["window_size"] = (sliding_window - 1, 0)
    if logits_soft_cap is not None:
        arguments["softcap"] = logits_soft_cap
    packed = pack_gqa_argument(pack_gqa, q.shape[1], k_cache.shape[2])
    if packed is not None:
        arguments["pack_gqa"] = packed
    return arguments


def pack_gqa_argument(choice: str, num_heads: int, num_kv_heads: int) -> bool | None:
    """flash-attn's ``pack_gqa`` for a ``VLLM_ACTORS_FLASH_ATTN_PACK_GQA`` choice: None (not passed:
    flash-attn packs whenever heads are grouped) for ``auto`` and for ungrouped heads, else on or off."""
    if choice not in PACK_GQA_CHOICES:
        raise ValueError(f"pack_gqa must be one of {', '.join(PACK_GQA_CHOICES)}, got {choice!r}")
    if choice == "auto" or num_heads == num_kv_heads:
        return None
    return choice == "on"


def takes_layer_options(varlen_func: VarlenFunc) -> bool:
    """Whether ``varlen_func`` has flash-attn 4's ``window_size`` and ``softcap`` arguments."""
    try:
        parameters = inspect.signature(varlen_func).parameters
    except (TypeError, ValueError):
        return False
    return "window_size" in parameters and "softcap" in parameters


def _load_varlen() -> VarlenFunc:
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def _replayed(varlen: VarlenFunc) -> VarlenFunc:
    """flash-attn's own function behind ``FlashAttnReplay`` (``VLLM_ACTORS_FLASH_ATTN_REPLAY``)."""
    if not envs.VLLM_ACTORS_FLASH_ATTN_REPLAY:
        return varlen
    import flash_attn.cute.interface as interface

    return FlashAttnReplay(varlen, interface)


class FlashAttnPrefill:
    """The prefill path on flash-attn 4: ``wants`` says whether a step goes to it (the choice rule of
    ``prefill_choice`` with this step's shapes), calling it attends the step (K/V already cached).

    ``varlen_func`` stands in for ``flash_attn.cute.flash_attn_varlen_func`` (tests); None imports it.
    ``pack_gqa``: ``auto``, ``on`` or ``off``; None reads ``VLLM_ACTORS_FLASH_ATTN_PACK_GQA``.
    """

    def __init__(
        self, choice: str = "auto", varlen_func: VarlenFunc | None = None, pack_gqa: str | None = None,
        split_keys: bool | None = None, num_sms: int | None = None,
    ) -> None:  # fmt: skip
        self.choice = choice
        self._varlen = varlen_func
        self.pack_gqa = str(envs.VLLM_ACTORS_FLASH_ATTN_PACK_GQA) if pack_gqa is None else pack_gqa
        pack_gqa_argument(self.pack_gqa, 2, 1)  # a bad choice fails here, not at the first prefill
        self.split_keys = bool(envs.VLLM_ACTORS_FLASH_ATTN_SPLIT_KEYS) if split_keys is None else split_keys
        self._num_sms = num_sms
        self._warm = False
        self._imported: VarlenFunc | None = None  # flash-attn's function, where ``function`` imported it
        self._caller: tuple[VarlenFunc, VarlenFunc] | None = None  # (function, what calls go through)

    def kernel(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        sliding_window: int | None = None,
    ) -> PrefillKernel:  # fmt: skip
        ready = layout_problem(q, k_cache, v_cache) is None
        planned = self.splits(q, k_cache, meta, sliding_window) if ready else None
        return step_kernel(self.choice, ready, meta.max_query_len, q.shape[-1], meta.context_of_longest_query(),
                           meta.num_seqs, meta.keys_beside_longest_query(), None if planned is None else planned[0])

    def outruns_padded_graph(self, query_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int,
                             num_kv_heads: int, head_dim: int, padded_tokens: int, device: torch.device) -> bool:
        """Whether a step of these lengths takes flash-attn here where the padded CUDA graph of
        ``padded_tokens`` rows cannot: the graph's kernel was chosen at capture from its token count
        alone (no context, no split), so a short chunk over a long context would stay on Triton there
        (the runner then runs the step eagerly). Host integers only; the layout is taken as fit."""
        longest = max(range(len(query_lens)), key=query_lens.__getitem__, default=0)
        if not self.split_keys or not query_lens or query_lens[longest] <= 1:
            return False  # without the split such steps keep their graph (as in the stream measured, session 22)
        context = seq_lens[longest] - query_lens[longest]
        plan = plan_key_splits(query_lens, seq_lens, block_size, num_heads, num_kv_heads, self.num_sms(device))
        here = step_kernel(self.choice, True, query_lens[longest], head_dim, context, len(query_lens),
                           sum(seq_lens) - seq_lens[longest], plan)
        return here == "flash_attn" and (plan is not None or prefill_kernel(self.choice, True, padded_tokens, head_dim)
                                         != "flash_attn")

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else 132
        return self._num_sms

    def splits(self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata,
               sliding_window: int | None = None) -> tuple[KeySplits, KeySplitTensors] | None:
        """The step's longest query split over its keys, planned once a step; None where it is not
        (off, a windowed layer, a query that fills the GPU or a short context)."""
        if not self.split_keys or sliding_window is not None:
            return None
        if meta.flash_splits is None:
            block_size = k_cache.shape[1]
            plan = plan_key_splits(meta.query_lens_cpu, meta.seq_lens_cpu, block_size, q.shape[1], k_cache.shape[2],
                                   self.num_sms(q.device))
            tensors = None if plan is None else split_tensors(plan, meta.block_tables, meta.seq_lens, block_size)
            meta.flash_splits = (plan, tensors)
        plan, tensors = meta.flash_splits
        return None if plan is None or tensors is None else (plan, tensors)

    def wants(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> bool:
        """Whether this step goes to flash-attn; a layer with a window or a soft cap only when the
        installed function takes them."""
        if (sliding_window is not None or logits_soft_cap is not None) and not takes_layer_options(self.function()):
            return False
        return self.kernel(q, k_cache, v_cache, meta, sliding_window) == "flash_attn"

    def function(self) -> VarlenFunc:
        """``flash_attn_varlen_func`` (or the stand-in given), imported on first use."""
        if self._varlen is None:
            self._varlen = self._imported = _load_varlen()
        return self._varlen

    def caller(self) -> VarlenFunc:
        """What the step's calls go through: flash-attn's function replayed (``flash_attn_replay``) where
        ``function`` imported it, a stand-in as given."""
        varlen = self.function()
        if self._caller is None or self._caller[0] is not varlen:
            self._caller = (varlen, _replayed(varlen) if varlen is self._imported else varlen)
        return self._caller[1]

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of the step's queries over their paged context: [T, num_heads, head_dim]."""
        arguments = varlen_arguments(q, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap, self.pack_gqa)
        if self.split_keys and not self._warm and q.is_cuda and not torch.cuda.is_current_stream_capturing():
            self._warm = True
            self.warm_up(arguments)
        split = self.splits(q, k_cache, meta, sliding_window)
        if split is None:
            out = self.caller()(**arguments)
            return out[0] if isinstance(out, tuple) else out  # (out, lse)
        plan, tensors = split
        return self.attend_split(arguments, plan, tensors)

    def attend_split(self, arguments: dict[str, Any], plan: KeySplits, tensors: KeySplitTensors) -> torch.Tensor:
        """The step's call with the split sequence's tail, the ranges' call, merged (``flash_attn_split``)."""
        varlen = self.caller()
        out, lse = varlen(**{**arguments, "page_table": tensors.tail_page_table, "seqused_k": tensors.tail_seqused,
                             "return_lse": True})
        q = arguments["q"]
        queries = q[plan.q_start : plan.q_start + plan.q_len].repeat(plan.num_splits, 1, 1)
        split_out, split_lse = varlen(**{
            **arguments, "q": queries, "cu_seqlens_q": tensors.split_cu_seqlens, "page_table": tensors.split_page_table,
            "seqused_k": tensors.split_seqused, "causal": False, "return_lse": True,
        })  # fmt: skip
        return merge_into(out, lse, plan, split_out, split_lse)

    def warm_up(self, arguments: dict[str, Any]) -> None:
        """Compile the split's two kernel variants (causal and not, with their log-sum-exp) on a tiny
        problem over the step's cache, at the first prefill (the engine's profiling step) rather than
        mid-serving at the first long chunk. Its result is dropped."""
        q, k_cache = arguments["q"], arguments["k"]
        block_size, device = k_cache.shape[1], q.device
        if k_cache.shape[0] < 1 or q.shape[0] < 1:
            return
        plan = KeySplits(seq=0, q_start=0, q_len=1, seq_len=2 * block_size, tail_block=1, blocks_per_split=1,
                         num_splits=1)
        tables = torch.zeros((1, 2), dtype=torch.int32, device=device)
        seq_lens = torch.full((1,), 2 * block_size, dtype=torch.int32, device=device)
        tensors = split_tensors(plan, tables, seq_lens, block_size)
        warm = {**arguments, "q": q[:1], "cu_seqlens_q": torch.tensor([0, 1], dtype=torch.int32, device=device)}
        self.attend_split(warm, plan, tensors)


def step_kernel(choice: str, ready: bool, max_query_len: int, head_dim: int, context: int, num_seqs: int,
                keys_beside: int, plan: KeySplits | None) -> PrefillKernel:
    """The step's kernel: its longest query's (``prefill_kernel``: ``context`` keys before it, ``keys_beside``
    the other sequences'), or where that leaves the step on Triton (a short prompt, no context), the split
    query's (``plan``) with its length and context: the long context's attention is the step's."""
    kernel = prefill_kernel(choice, ready, max_query_len, head_dim, context, num_seqs, keys_beside, plan is not None)
    if kernel == "flash_attn" or plan is None:
        return kernel
    total_keys = keys_beside + context + max_query_len
    return prefill_kernel(choice, True, plan.q_len, head_dim, plan.seq_len - plan.q_len, num_seqs,
                          total_keys - plan.seq_len, True)


def flash_attn_prefill_for(device: torch.device) -> FlashAttnPrefill | None:
    """The flash-attn 4 prefill path for ``device`` as ``VLLM_ACTORS_PREFILL_ATTENTION`` asks: None for
    ``triton``, and for ``auto`` where flash-attn 4 cannot run; ``flash_attn`` there is an error."""
    choice = prefill_choice()
    if choice == "triton":
        return None
    reason = flash_attn_unavailable(torch.device(device))
    if reason is not None:
        if choice == "flash_attn":
            raise ValueError(
                f"VLLM_ACTORS_PREFILL_ATTENTION=flash_attn needs flash-attn 4 (flash_attn.cute) on a Hopper GPU: "
                f"{reason}; use auto or triton"
            )
        # installed but not importable on a Hopper GPU is worth a warning: prefills lose their fast path
        broken = "does not import" in reason and "No module named 'flash_attn'" not in reason
        (log.warning if broken else log.debug)("flash_attn_prefill_off", reason=reason)
        return None
    log.info("flash_attn_prefill_on", choice=choice)
    return FlashAttnPrefill(choice)
