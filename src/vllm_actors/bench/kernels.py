"""GPU microbenchmark of the Triton paged-attention kernels against torch references.

At Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128), bf16, block size 16:

* decode, batch {1, 64, 256} x context {512, 2048}: the Triton decode kernel (plus split reduce)
  against SDPA on KV gathered through the block tables (gather included), SDPA alone on KV gathered
  beforehand, and the project's torch reference backend (a loop over sequences); achieved GB/s is
  the KV bytes the step must read over the time;
* prefill of 8 sequences x 1024 new tokens: the Triton varlen kernel against causal SDPA on the
  gathered KV; TFLOP/s counts the causal half only (4 * D flops per visible query-key pair);
* the KV write of each batch's new tokens.

Each case also checks the Triton output against the torch reference. Times are medians of
`triton.testing.do_bench`. Usage: python benchmarks/kernels.py [--out results/kernels.json].
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Row:
    kind: str  # "decode" | "prefill"
    batch: int
    context: int  # keys per sequence
    query_len: int
    triton_ms: float
    sdpa_gather_ms: float  # gather through block tables + SDPA
    sdpa_only_ms: float  # SDPA on KV gathered beforehand
    torch_backend_ms: float | None  # the TorchPagedAttention loop (None: skipped)
    kv_write_ms: float
    num_splits: int | None
    rel_err: float
    metric: float  # GB/s (decode) or TFLOP/s (prefill) of the Triton kernel
    metric_unit: str
    extra: dict[str, float] = field(default_factory=dict)


def _bench(fn: Callable[[], object], warmup_ms: int, rep_ms: int) -> float:
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except TypeError:  # older signature without return_mode
        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])[0])


@dataclass
class Setup:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: object  # AttentionMetadata
    tables: torch.Tensor  # [B, blocks_per_seq] int64, for the torch gathers


def _setup(
    batch: int,
    context: int,
    query_len: int,
    heads: tuple[int, int, int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> Setup:
    """Random caches with every sequence at `context` tokens, the last query_len of them new,
    its blocks scattered over the cache by a random permutation."""
    from vllm_actors.kernels.attention import build_attention_metadata

    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq + 8
    perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq].view(batch, blocks_per_seq)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    tokens = batch * query_len
    meta = build_attention_metadata([query_len] * batch, [context] * batch, perm.tolist(), block_size, device)
    return Setup(
        q=torch.randn(tokens, num_heads, head_dim, device=device, dtype=dtype),
        k=torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype),
        v=torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        tables=perm.to(device),
    )


def _gather(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, context, D] from the paged cache (all sequences the same length)."""
    batch = tables.shape[0]
    blocks = cache.index_select(0, tables.flatten())  # [B * nb, bs, Hkv, D]
    dense = blocks.view(batch, -1, cache.shape[2], cache.shape[3])[:, :context]
    return dense.transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def bench_decode(
    batch: int, context: int, args: argparse.Namespace, device: torch.device, splits: int | None = None
) -> Row:
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    heads = (args.num_heads, args.num_kv_heads, args.head_dim)
    dtype = DTYPES[args.dtype]
    s = _setup(batch, context, 1, heads, args.block_size, dtype, device, seed=batch * 7919 + context)
    meta = s.meta
    scale = args.head_dim**-0.5
    ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping)
    num_splits = splits or ta.choose_decode_splits(batch, args.num_kv_heads, context, device)

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_decode(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_seq_len, scale, num_splits=num_splits,
        )  # fmt: skip

    q4 = s.q.unsqueeze(2)  # [B, H, 1, D]

    def gather_sdpa() -> torch.Tensor:
        k = _gather(s.k_cache, s.tables, context)
        v = _gather(s.v_cache, s.tables, context)
        return _sdpa(q4, k, v, scale, causal=False)

    k_dense = _gather(s.k_cache, s.tables, context).contiguous()
    v_dense = _gather(s.v_cache, s.tables, context).contiguous()
    reference = _sdpa(q4.float(), k_dense.float(), v_dense.float(), scale, causal=False).squeeze(2)
    rel = _rel_err(triton_step(), reference)

    triton_ms = _bench(triton_step, args.warmup_ms, args.rep_ms)
    gather_ms = _bench(gather_sdpa, args.warmup_ms, args.rep_ms)
    sdpa_ms = _bench(lambda: _sdpa(q4, k_dense, v_dense, scale, causal=False), args.warmup_ms, args.rep_ms)
    torch_ms: float | None = None
    if batch <= args.torch_backend_max_batch:
        backend = TorchPagedAttention()
        torch_ms = _bench(
            lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args.warmup_ms, args.rep_ms
        )
    write_ms = _bench(
        lambda: ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping), args.warmup_ms, args.rep_ms
    )
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * s.k_cache.element_size()
    return Row(
        kind="decode",
        batch=batch,
        context=context,
        query_len=1,
        triton_ms=triton_ms,
        sdpa_gather_ms=gather_ms,
        sdpa_only_ms=sdpa_ms,
        torch_backend_ms=torch_ms,
        kv_write_ms=write_ms,
        num_splits=num_splits,
        rel_err=rel,
        metric=kv_bytes / (triton_ms * 1e-3) / 1e9,
        metric_unit="GB/s",
        extra={"sdpa_only_GBps": kv_bytes / (sdpa_ms * 1e-3) / 1e9},
    )


def bench_prefill(batch: int, length: int, args: argparse.Namespace, device: torch.device) -> Row:
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    heads = (args.num_heads, args.num_kv_heads, args.head_dim)
    dtype = DTYPES[args.dtype]
    s = _setup(batch, length, length, heads, args.block_size, dtype, device, seed=batch + length)
    meta = s.meta
    scale = args.head_dim**-0.5
    ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping)

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_varlen(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )  # fmt: skip

    q4 = s.q.view(batch, length, args.num_heads, args.head_dim).transpose(1, 2)

    def gather_sdpa() -> torch.Tensor:
        k = _gather(s.k_cache, s.tables, length)
        v = _gather(s.v_cache, s.tables, length)
        return _sdpa(q4, k, v, scale, causal=True)

    k_dense = _gather(s.k_cache, s.tables, length).contiguous()
    v_dense = _gather(s.v_cache, s.tables, length).contiguous()
    reference = _sdpa(q4.float(), k_dense.float(), v_dense.float(), scale, causal=True)
    reference = reference.transpose(1, 2).reshape(-1, args.num_heads, args.head_dim)
    rel = _rel_err(triton_step(), reference)

    triton_ms = _bench(triton_step, args.warmup_ms, args.rep_ms)
    gather_ms = _bench(gather_sdpa, args.warmup_ms, args.rep_ms)
    sdpa_ms = _bench(lambda: _sdpa(q4, k_dense, v_dense, scale, causal=True), args.warmup_ms, args.rep_ms)
    backend = TorchPagedAttention()
    torch_ms = _bench(
        lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args.warmup_ms, args.rep_ms
    )
    write_ms = _bench(
        lambda: ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping), args.warmup_ms, args.rep_ms
    )
    flops = 4 * batch * args.num_heads * args.head_dim * length * (length + 1) / 2
    return Row(
        kind="prefill",
        batch=batch,
        context=length,
        query_len=length,
        triton_ms=triton_ms,
        sdpa_gather_ms=gather_ms,
        sdpa_only_ms=sdpa_ms,
        torch_backend_ms=torch_ms,
        kv_write_ms=write_ms,
        num_splits=None,
        rel_err=rel,
        metric=flops / (triton_ms * 1e-3) / 1e12,
        metric_unit="TFLOP/s",
        extra={"sdpa_only_TFLOPs": flops / (sdpa_ms * 1e-3) / 1e12},
    )


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'kind':<8}{'B':>5}{'ctx':>7}{'splits':>7}{'triton ms':>11}{'gather+sdpa':>13}{'sdpa only':>11}"
        f"{'torch loop':>12}{'kv write':>10}{'speedup':>9}{'metric':>16}{'rel err':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        torch_ms = f"{r.torch_backend_ms:.3f}" if r.torch_backend_ms is not None else "-"
        lines.append(
            f"{r.kind:<8}{r.batch:>5}{r.context:>7}{(r.num_splits or '-'):>7}{r.triton_ms:>11.4f}"
            f"{r.sdpa_gather_ms:>13.4f}{r.sdpa_only_ms:>11.4f}{torch_ms:>12}{r.kv_write_ms:>10.4f}"
            f"{r.sdpa_gather_ms / r.triton_ms:>8.2f}x{r.metric:>10.1f} {r.metric_unit:<7}{r.rel_err:>8.1e}"
        )
    lines.append("speedup = gather+sdpa / triton; metric is the Triton kernel's achieved rate")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--prefill", type=int, nargs=2, default=[8, 1024], metavar=("BATCH", "LENGTH"))
    p.add_argument("--sweep-splits", type=int, nargs="*", default=[], help="also time these decode split counts")
    p.add_argument("--torch-backend-max-batch", type=int, default=64, help="skip the torch loop above this batch")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--max-rel-err", type=float, default=2e-2, help="exit 1 when a case's error is above this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run")
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/kernels.py needs triton (pip install 'vllm_actors[kernels]')")
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[Row] = []
    sweep: list[Row] = []
    for batch in args.batches:
        for context in args.contexts:
            rows.append(bench_decode(batch, context, args, device))
            log.info("decode_done", batch=batch, context=context, ms=rows[-1].triton_ms)
            for splits in args.sweep_splits:
                sweep.append(bench_decode(batch, context, args, device, splits=splits))
    batch, length = args.prefill
    rows.append(bench_prefill(batch, length, args, device))
    table = format_table(rows)
    sys.stdout.write(f"{torch.cuda.get_device_name(device)}, {args.dtype}, block size {args.block_size}, "
                     f"heads {args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim}\n{table}\n")
    if sweep:
        sys.stdout.write("split sweep (decode)\n" + format_table(sweep) + "\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": [asdict(r) for r in rows],
            "split_sweep": [asdict(r) for r in sweep],
        }
        args.out.write_text(json.dumps(payload, indent=2))
    bad = [r for r in rows + sweep if not r.rel_err <= args.max_rel_err]
    if bad:
        sys.exit(f"{len(bad)} case(s) differ from the torch reference by more than {args.max_rel_err}")


if __name__ == "__main__":
    main()
