"""GPU microbenchmark of the Triton paged-attention kernels against torch references.

At Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128), bf16, block size 16:

* decode, batch {1, 64, 256} x context {512, 2048}: the Triton decode kernel (with its split
  reduce) against SDPA on KV gathered through the block tables (gather included), SDPA alone on
  KV gathered beforehand, and the project's torch reference backend (a Python loop over
  sequences). Decode is also timed inside CUDA graphs (how the engine runs it), which removes the
  Python launch cost that dominates small batches. GB/s counts the KV bytes the step must read;
* prefill of 8 sequences x 1024 new tokens: Triton varlen against causal SDPA; TFLOP/s counts the
  causal half only (4 * D flops per visible query-key pair);
* a chunked-prefill step (one 512-token chunk on a 1536-token prefix beside 63 decodes at 2048):
  the Triton varlen kernel against the torch reference backend;
* the KV write of each batch's new tokens.

Every case checks the Triton output against a float32 torch computation. Times are medians of
`triton.testing.do_bench`, in milliseconds. Usage:

    python benchmarks/kernels.py [--out results/kernels.json]
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
    kind: str  # "decode" | "prefill" | "mixed"
    batch: int
    context: int  # keys per sequence (the longest, for mixed)
    query_len: int  # new tokens per sequence (the longest, for mixed)
    num_splits: int | None
    rel_err: float
    ms: dict[str, float]  # timings by name; "triton" is the kernel under test
    metric: float  # GB/s (decode) or TFLOP/s (prefill) of the Triton kernel
    metric_unit: str
    notes: dict[str, float] = field(default_factory=dict)


def _bench(fn: Callable[[], object], args: argparse.Namespace) -> float:
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
    except TypeError:  # a triton without return_mode
        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, quantiles=[0.5])[0])


def _bench_graph(fn: Callable[[], object], args: argparse.Namespace, calls: int = 20) -> float:
    """Per-call time of fn replayed from a CUDA graph holding `calls` calls of it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _bench(graph.replay, args) / calls


def _spin_up(seconds: float = 0.2) -> None:
    """Keep the GPU busy for a moment so that timings start at full clocks."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


@dataclass
class Setup:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: object  # AttentionMetadata
    tables: list[list[int]]


def _setup(
    query_lens: list[int],
    seq_lens: list[int],
    args: argparse.Namespace,
    device: torch.device,
    seed: int,
) -> Setup:
    """Random caches and tokens; every sequence's blocks scattered over the cache by a permutation.
    The new tokens' k/v are already written (as the backend does before attending)."""
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import build_attention_metadata

    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [math.ceil(n / args.block_size) for n in seq_lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for n in need:
        tables.append(perm[:n])
        perm = perm[n:]
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    tokens = sum(query_lens)
    s = Setup(
        q=torch.randn(tokens, args.num_heads, args.head_dim, device=device, dtype=dtype),
        k=torch.randn(tokens, args.num_kv_heads, args.head_dim, device=device, dtype=dtype),
        v=torch.randn(tokens, args.num_kv_heads, args.head_dim, device=device, dtype=dtype),
        k_cache=torch.randn(shape, device=device, dtype=dtype),
        v_cache=torch.randn(shape, device=device, dtype=dtype),
        meta=build_attention_metadata(query_lens, seq_lens, tables, args.block_size, device),
        tables=tables,
    )
    ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, s.meta.slot_mapping)
    return s


def _gather(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, context, D] read through the block tables [B, blocks] (every sequence `context` long)."""
    batch = tables.shape[0]
    blocks = cache.index_select(0, tables.flatten())
    return blocks.view(batch, -1, cache.shape[2], cache.shape[3])[:, :context].transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def _reference(s: Setup, scale: float) -> torch.Tensor:
    """float32 paged attention through the torch reference (its KV write is an idempotent rewrite)."""
    from vllm_actors.kernels.attention import TorchPagedAttention

    return TorchPagedAttention().forward(
        s.q.float(), s.k.float(), s.v.float(), s.k_cache.float(), s.v_cache.float(), s.meta, scale
    )


def bench_decode(
    batch: int, context: int, args: argparse.Namespace, device: torch.device, splits: int | None = None
) -> Row:
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    s = _setup([1] * batch, [context] * batch, args, device, seed=batch * 7919 + context)
    meta = s.meta
    scale = args.head_dim**-0.5
    num_splits = splits or ta.choose_decode_splits(batch, args.num_kv_heads, context, device)
    out = torch.empty_like(s.q)

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_decode(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_seq_len, scale, out=out, num_splits=num_splits,
        )  # fmt: skip

    tables = torch.tensor(s.tables, dtype=torch.long, device=device)
    q4 = s.q.unsqueeze(2)  # [B, H, 1, D]

    def gather_sdpa() -> torch.Tensor:
        return _sdpa(q4, _gather(s.k_cache, tables, context), _gather(s.v_cache, tables, context), scale, False)

    k_dense = _gather(s.k_cache, tables, context).contiguous()
    v_dense = _gather(s.v_cache, tables, context).contiguous()
    rel = _rel_err(triton_step(), _reference(s, scale))

    _spin_up()
    ms = {
        "triton": _bench(triton_step, args),
        "triton_graph": _bench_graph(triton_step, args),
        "gather_sdpa": _bench(gather_sdpa, args),
        "gather_sdpa_graph": _bench_graph(gather_sdpa, args),
        "sdpa_only": _bench(lambda: _sdpa(q4, k_dense, v_dense, scale, False), args),
        "kv_write": _bench(lambda: ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping), args),
    }
    if batch <= args.torch_backend_max_batch:
        backend = TorchPagedAttention()
        ms["torch_loop"] = _bench(lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args)
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * s.k_cache.element_size()
    return Row(
        kind="decode",
        batch=batch,
        context=context,
        query_len=1,
        num_splits=num_splits,
        rel_err=rel,
        ms=ms,
        metric=kv_bytes / (ms["triton_graph"] * 1e-3) / 1e9,
        metric_unit="GB/s",
        notes={"kv_bytes": kv_bytes, "sdpa_only_GBps": kv_bytes / (ms["sdpa_only"] * 1e-3) / 1e9},
    )


def bench_prefill(batch: int, length: int, args: argparse.Namespace, device: torch.device) -> Row:
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    s = _setup([length] * batch, [length] * batch, args, device, seed=batch + length)
    meta = s.meta
    scale = args.head_dim**-0.5

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_varlen(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )  # fmt: skip

    tables = torch.tensor(s.tables, dtype=torch.long, device=device)
    q4 = s.q.view(batch, length, args.num_heads, args.head_dim).transpose(1, 2)

    def gather_sdpa() -> torch.Tensor:
        return _sdpa(q4, _gather(s.k_cache, tables, length), _gather(s.v_cache, tables, length), scale, True)

    k_dense = _gather(s.k_cache, tables, length).contiguous()
    v_dense = _gather(s.v_cache, tables, length).contiguous()
    rel = _rel_err(triton_step(), _reference(s, scale))

    backend = TorchPagedAttention()
    _spin_up()
    ms = {
        "triton": _bench(triton_step, args),
        "gather_sdpa": _bench(gather_sdpa, args),
        "sdpa_only": _bench(lambda: _sdpa(q4, k_dense, v_dense, scale, True), args),
        "torch_loop": _bench(lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args),
        "kv_write": _bench(lambda: ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping), args),
    }
    flops = 4 * batch * args.num_heads * args.head_dim * length * (length + 1) / 2
    return Row(
        kind="prefill",
        batch=batch,
        context=length,
        query_len=length,
        num_splits=None,
        rel_err=rel,
        ms=ms,
        metric=flops / (ms["triton"] * 1e-3) / 1e12,
        metric_unit="TFLOP/s",
        notes={"flops": flops, "sdpa_only_TFLOPs": flops / (ms["sdpa_only"] * 1e-3) / 1e12},
    )


def bench_mixed(args: argparse.Namespace, device: torch.device) -> Row:
    """A chunked-prefill step: a 512-token chunk on a 1536-token prefix beside 63 decodes at 2048."""
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    query_lens = [512] + [1] * 63
    seq_lens = [2048] * 64
    s = _setup(query_lens, seq_lens, args, device, seed=64)
    meta = s.meta
    scale = args.head_dim**-0.5

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_varlen(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )  # fmt: skip

    rel = _rel_err(triton_step(), _reference(s, scale))
    backend = TorchPagedAttention()
    _spin_up()
    ms = {
        "triton": _bench(triton_step, args),
        "torch_loop": _bench(lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args),
    }
    kv_bytes = 2 * sum(seq_lens) * args.num_kv_heads * args.head_dim * s.k_cache.element_size()
    return Row(
        kind="mixed",
        batch=len(query_lens),
        context=max(seq_lens),
        query_len=max(query_lens),
        num_splits=None,
        rel_err=rel,
        ms=ms,
        metric=kv_bytes / (ms["triton"] * 1e-3) / 1e9,
        metric_unit="GB/s",
        notes={"kv_bytes": kv_bytes},
    )


@dataclass
class FusedRow:
    op: str
    tokens: int
    triton_graph_ms: float
    torch_graph_ms: float
    max_abs_diff: float


def bench_fused(args: argparse.Namespace, device: torch.device) -> list[FusedRow]:
    """The fused elementwise kernels against unfused torch code at Qwen3-0.6B's sizes (hidden 1024,
    MLP 3072), both timed per call from CUDA graphs."""
    from vllm_actors.kernels import fused_ops

    dtype = DTYPES[args.dtype]
    hidden, inter = args.hidden_size, args.intermediate_size
    rows: list[FusedRow] = []
    weight, eps = torch.randn(hidden, device=device, dtype=dtype), 1e-6

    def norm(x: torch.Tensor) -> torch.Tensor:  # the unfused torch RMSNorm
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)

    inv_freq = 1.0 / (1e6 ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim))
    for tokens in args.fused_tokens:
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        r = torch.randn(tokens, hidden, device=device, dtype=dtype)
        gate = torch.randn(tokens, inter, device=device, dtype=dtype)
        up = torch.randn(tokens, inter, device=device, dtype=dtype)
        q = torch.randn(tokens, args.num_heads, args.head_dim, device=device, dtype=dtype)
        k = torch.randn(tokens, args.num_kv_heads, args.head_dim, device=device, dtype=dtype)
        positions = torch.arange(tokens, device=device)

        # the model builds cos/sin once per step for all layers: time only the per-layer part
        angles = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

        def torch_rotary() -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        half_cos, half_sin = cos[:, : args.head_dim // 2].float(), sin[:, : args.head_dim // 2].float()
        gate_up = torch.cat((gate, up), dim=-1)
        cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
            ("add+rms_norm", lambda: fused_ops.rms_norm(x, weight, eps, r), lambda: norm(x + r)),
            ("silu_and_mul", lambda: fused_ops.silu_and_mul(gate_up), lambda: F.silu(gate) * up),
            ("rotary_qk", lambda: fused_ops.qk_norm_rope(q.clone(), k.clone(), half_cos, half_sin, None, None, eps),
             torch_rotary),
        ]
        with torch.no_grad():
            for op, fused, eager in cases:
                got, want = fused(), eager()
                got = got[0] if isinstance(got, tuple) else got
                want = want[0] if isinstance(want, tuple) else want
                rows.append(
                    FusedRow(
                        op=op,
                        tokens=tokens,
                        triton_graph_ms=_bench_graph(fused, args),
                        torch_graph_ms=_bench_graph(eager, args),
                        max_abs_diff=float((got.float() - want.float()).abs().max()),
                    )
                )
    return rows


def format_fused(rows: list[FusedRow]) -> str:
    head = f"{'op':<14}{'tokens':>8}{'triton_graph':>14}{'torch_graph':>13}{'speedup':>9}{'max|diff|':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<14}{r.tokens:>8}{r.triton_graph_ms:>14.4f}{r.torch_graph_ms:>13.4f}"
            f"{r.torch_graph_ms / r.triton_graph_ms:>8.2f}x{r.max_abs_diff:>11.2e}"
        )
    return "\n".join(lines)


COLUMNS = ["triton", "triton_graph", "gather_sdpa", "gather_sdpa_graph", "sdpa_only", "torch_loop", "kv_write"]


def format_table(rows: list[Row]) -> str:
    head = f"{'kind':<8}{'B':>5}{'ctx':>6}{'split':>6}" + "".join(f"{c:>18}" for c in COLUMNS)
    head += f"{'metric':>18}{'rel err':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{r.ms[c]:>18.4f}" if c in r.ms else f"{'-':>18}" for c in COLUMNS)
        lines.append(
            f"{r.kind:<8}{r.batch:>5}{r.context:>6}{(r.num_splits or '-'):>6}{cells}"
            f"{r.metric:>10.1f} {r.metric_unit:<7}{r.rel_err:>9.1e}"
        )
    lines.append(
        "times in ms (medians); *_graph: per call replayed from a CUDA graph; metric: the Triton kernel's rate "
        "(decode from triton_graph)"
    )
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
    p.add_argument("--no-mixed", action="store_true", help="skip the chunked-prefill case")
    p.add_argument("--no-fused", action="store_true", help="skip the fused elementwise kernels")
    p.add_argument("--fused-tokens", type=int, nargs="+", default=[1, 64, 8192])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=3072)
    p.add_argument("--sweep-splits", type=int, nargs="*", default=[], help="also time these decode split counts")
    p.add_argument("--torch-backend-max-batch", type=int, default=64, help="skip the torch loop above this batch")
    p.add_argument("--warmup-ms", type=int, default=50)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--max-rel-err", type=float, default=2e-2, help="exit 1 when a case's error is above this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run")
    try:
        import triton
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
            log.info("decode_case_done", batch=batch, context=context, ms=rows[-1].ms["triton_graph"])
            for splits in args.sweep_splits:
                sweep.append(bench_decode(batch, context, args, device, splits=splits))
    batch, length = args.prefill
    rows.append(bench_prefill(batch, length, args, device))
    if not args.no_mixed:
        rows.append(bench_mixed(args, device))
    title = (
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{args.dtype}, block size {args.block_size}, heads {args.num_heads}/{args.num_kv_heads}, "
        f"head_dim {args.head_dim}"
    )
    sys.stdout.write(f"{title}\n{format_table(rows)}\n")
    if sweep:
        sys.stdout.write(f"decode split sweep\n{format_table(sweep)}\n")
    fused = [] if args.no_fused else bench_fused(args, device)
    if fused:
        sys.stdout.write(f"fused elementwise kernels (ms per call from CUDA graphs)\n{format_fused(fused)}\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "title": title,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": [asdict(r) for r in rows],
            "split_sweep": [asdict(r) for r in sweep],
            "fused": [asdict(r) for r in fused],
        }
        args.out.write_text(json.dumps(payload, indent=2))
    bad = [r for r in rows + sweep if not r.rel_err <= args.max_rel_err]
    if bad:
        sys.exit(f"{len(bad)} case(s) differ from the torch reference by more than {args.max_rel_err}")


if __name__ == "__main__":
    main()
