"""Where a layer's exchange of KV borrowing goes (``models/kv_borrow_link.py``): a home asking one lender
over gloo, as a guest's step does once a layer, timed phase by phase on both sides.

    bash benchmarks/gpu_session.sh py -- benchmarks/kv_borrow_exchange.py --out $OUT/kvx.json   # 2 GPUs
    python benchmarks/kv_borrow_exchange.py --cpu --layers 2 --heads 2 --kv-heads 1 --head-dim 8 \
        --lent-tokens 256 --block-size 16 --steps 3 --tokens 1 8 --busy-lender none python

Two processes (``torch.multiprocessing`` spawn, a gloo group met at a file store): rank 0 the home,
rank 1 the lender, on cuda:0 and cuda:1 where CUDA has two devices, else on the CPU. The lender holds
a ``LenderShare`` over caches shaped as the engine's ([blocks, block size, KV heads, head_dim] per
layer, K and V), with ``--lent-tokens`` of context lent to the guest in shuffled blocks, attended on
the GPU kernels the engine picks (``kv_parallel.gpu_partial_attention``). The guest's new tokens fall
after the loan (in the home's blocks), so every query sees every lent key.

For each (``--tokens``, ``--busy-lender``) it measures, ``--steps`` steps of ``--layers`` calls each
(after ``--warmup`` steps):

* ``pingpong``: a bare gloo round trip of the same messages (header, request id, packed q/k/v; the
  reply) between host buffers (pinned on GPUs), answered by a thread of the lender: the transport's
  floor, no device copy, no attention.
* ``inproc``: ``LenderShare.attend`` called directly by a thread of the lender (its own stream, as
  ``LenderServer``'s), timed to a sync of that stream: the compute, no transport.
* the exchange itself: ``RemoteLender`` and ``PendingReply`` on the home, ``LenderServer`` on the
  lender. The home's round trip runs from the call to the reply on its device (after a sync); its
  parts: ``pack`` (the concatenation), ``d2h`` (the copy to pinned memory and the stream sync),
  ``alloc`` (host buffers), ``send`` (the three sends), ``wait`` (the reply's receive), ``h2d``
  (the reply's copy to the device, timed to a sync). The lender's call: ``recv_wait`` (the header's
  receive: idle until the home asks), ``recv`` (request id and payload), ``alloc``, ``h2d`` (to a
  sync), ``attend`` (the call returning) and ``attend_sync`` (then the stream's sync), ``d2h`` (the
  reply to pinned memory, its sync), ``send``; ``answer`` is the call less ``recv_wait``.
  ``other`` is what no part holds (torch.cat, unpacking, the header tensors, the NaN check).

Every part is timed by wrapping the link module's functions (``host_buffer``, ``to_host``,
``to_device``, its ``dist``) and subclassing ``LenderShare``, ``LenderServer`` and ``QkvStaging``
in these processes (``benchmarks/lib/kv_borrow_timing.py``), with exclusive times (a part nested
in another counts once). The syncs added to time ``h2d`` and ``attend`` cost some microseconds a
call. A wait for the GIL lands in the part whose call released it.

``--busy-lender`` is what the lender's main thread does meanwhile: ``none`` (it waits in a join);
``python`` (the worker's busy poll: a zero-timeout look, a little Python, ``time.sleep(0)``);
``prep`` (stretches of pure Python, ~1-2 ms each, between those looks: a step's preparation, which hands
the GIL to a waiting thread only at the switch interval);
``gpu`` (matmuls of the 8B shape on its default stream, ``--busy-matmuls`` a step, then that poll
on the step's event until it is done, as the worker waits for its step). ``--switch-interval`` sets
the lender's GIL switch interval (``sys.setswitchinterval``) to test the GIL's part.

Prints three tables (milliseconds, p50) and writes every figure (p50, p90, mean) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vllm_actors.models import kv_borrow_link as link
from vllm_actors.models.kv_borrow_link import (
    HEADER,
    RemoteLender,
    SharedRegions,
    as_bytes,
    host_buffer,
)
from vllm_actors.models.kv_parallel import gpu_partial_attention
from vllm_actors.runtime.shm_regions import region_prefix

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib
from benchmarks.lib.kv_borrow_timing import (  # noqa: E402
    PHASES,
    Busy,
    TimedServer,
    TimedShare,
    TimedStaging,
    instrument,
    sync,
)

GUEST = "guest"
ASK, ANSWER = 11, 12  # the ping-pong's tags (the exchange's are the link's)


def stats(values: list[float]) -> dict[str, float]:
    """p50, p90 and mean of seconds, in milliseconds."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": 0.0, "p90": 0.0, "mean": 0.0}

    def at(q: float) -> float:
        return ordered[round(q * (len(ordered) - 1))] * 1e3

    return {"p50": at(0.5), "p90": at(0.9), "mean": statistics.fmean(ordered) * 1e3}


def summarize(records: list[dict[str, float]], parts: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Each part's stats over the calls (0 in a call without it; ``parts`` listed even where none had them,
    as ``alloc`` under shared memory)."""
    names = sorted({name for record in records for name in record} | set(parts))
    return {name: stats([record.get(name, 0.0) for record in records]) for name in names}


def shapes(args: argparse.Namespace, tokens: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The packed q/k/v's shape and the reply's."""
    return ((tokens, args.heads + 2 * args.kv_heads, args.head_dim), (tokens, args.heads, args.head_dim + 1))


def wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def run_thread(target: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    def guarded() -> None:
        try:
            target()
        except BaseException as error:  # re-raised by the main thread after its join
            errors.append(error)

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    return thread


def run_home(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, group: Any) -> list[dict[str, Any]]:
    calls, warm = args.steps * args.layers, args.warmup * args.layers
    scale = args.head_dim ** -0.5
    generator = torch.Generator(device).manual_seed(args.seed)
    rows = []
    for mode in args.busy_lender:
        for tokens in args.tokens:
            packed_shape, reply_shape = shapes(args, tokens)
            row: dict[str, Any] = {"tokens": tokens, "busy": mode}
            # the bare round trip, host buffers only
            dist.barrier()
            header = torch.zeros(HEADER, dtype=torch.float64)
            name = torch.tensor(list(GUEST.encode()), dtype=torch.uint8)
            payload = host_buffer(packed_shape, dtype, device)
            reply = host_buffer(reply_shape, wide(dtype), device)
            times = []
            for _ in range(warm + calls):
                start = time.perf_counter()
                for tensor in (header, name, as_bytes(payload)):
                    dist.send(tensor, 1, group=group, tag=ASK)
                dist.recv(as_bytes(reply), 1, group=group, tag=ANSWER)
                times.append(time.perf_counter() - start)
            row["pingpong_ms"] = stats(times[warm:])
            row["payload_bytes"] = payload.numel() * payload.element_size()
            row["reply_bytes"] = reply.numel() * reply.element_size()
            dist.barrier()  # the lender attends in process meanwhile
            # the exchange
            dist.barrier()
            remote = RemoteLender(1, group, TimedStaging(regions(args, device), 0))
            seq_len = args.lent_blocks * args.block_size + tokens  # the new tokens after the loan
            base = torch.randn(packed_shape, generator=generator, device=device).to(dtype)
            records = []
            for call in range(warm + calls):
                layer = call % args.layers
                qkv = base * 1.0  # new q, k and v each layer (views of one projection), as the model's
                q, k, v = qkv.split((args.heads, args.kv_heads, args.kv_heads), dim=1)
                sync(device)
                PHASES.reset()
                start = time.perf_counter()
                out, lse = remote(layer, GUEST, 0, q, k, v, seq_len, scale).wait()
                sync(device)
                round_trip = time.perf_counter() - start
                record = PHASES.take()
                record["other"] = round_trip - sum(record.values())
                record["round_trip"] = round_trip
                records.append(record)
            remote.stop()
            row["home_ms"] = summarize(records[warm:], HOME_PARTS)
            row["calls"] = calls
            rows.append(row)
            trip = row["home_ms"]["round_trip"]
            print(f"tokens {tokens} busy {mode}: round trip p50 {trip['p50']:.3f} ms, p90 {trip['p90']:.3f} ms, "
                  f"pingpong p50 {row['pingpong_ms']['p50']:.3f} ms", flush=True)  # for a run cut short
    return rows


def make_share(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> TimedShare:
    """The lender's caches (every layer's K and V) and its loan to the guest, in shuffled blocks."""
    generator = torch.Generator(device).manual_seed(args.seed + 1)
    num_blocks = args.lent_blocks + 4
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    caches = [(torch.randn(shape, generator=generator, device=device).to(dtype),
               torch.randn(shape, generator=generator, device=device).to(dtype)) for _ in range(args.layers)]
    share = TimedShare(caches, kernels=gpu_partial_attention(device))
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(args.seed))
    share.lend(GUEST, order[: args.lent_blocks].tolist())
    sync(device)
    return share


def run_lender(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, group: Any) -> list[dict[str, Any]]:
    calls, warm = args.steps * args.layers, args.warmup * args.layers
    scale = args.head_dim ** -0.5
    share = make_share(args, device, dtype)
    rows = []
    for mode in args.busy_lender:
        busy = Busy(mode, device, args.busy_matmul, args.busy_matmuls, dtype)
        for tokens in args.tokens:
            packed_shape, reply_shape = shapes(args, tokens)
            row: dict[str, Any] = {"tokens": tokens, "busy": mode}
            errors: list[BaseException] = []

            def pong(packed_shape: tuple[int, int, int] = packed_shape,
                     reply_shape: tuple[int, int, int] = reply_shape) -> None:
                header = torch.empty(HEADER, dtype=torch.float64)
                name = torch.empty(len(GUEST), dtype=torch.uint8)
                payload = host_buffer(packed_shape, dtype, device)
                reply = host_buffer(reply_shape, wide(dtype), device)
                for _ in range(warm + calls):
                    for tensor in (header, name, as_bytes(payload)):
                        dist.recv(tensor, 0, group=group, tag=ASK)
                    dist.send(as_bytes(reply), 0, group=group, tag=ANSWER)

            dist.barrier()
            row["pingpong_busy_iterations"] = busy.run_while(run_thread(pong, errors))
            seq_len = args.lent_blocks * args.block_size + tokens
            inproc: list[dict[str, float]] = []

            def attend_here(tokens: int = tokens, seq_len: int = seq_len,
                            inproc: list[dict[str, float]] = inproc) -> None:
                with link.lender_context(device):  # the thread's device and stream, as LenderServer's
                    q, k, v = (torch.randn(tokens, heads, args.head_dim, device=device).to(dtype)
                               for heads in (args.heads, args.kv_heads, args.kv_heads))
                    for call in range(warm + calls):
                        PHASES.reset()
                        share.attend(call % args.layers, GUEST, 0, q, k, v, seq_len, scale)
                        inproc.append(PHASES.take())

            row["inproc_busy_iterations"] = busy.run_while(run_thread(attend_here, errors))
            dist.barrier()
            if errors:
                raise errors[0]
            row["inproc_ms"] = {"attend": stats([r["attend"] + r["attend_sync"] for r in inproc[warm:]]),
                                "launch": stats([r["attend"] for r in inproc[warm:]])}
            dist.barrier()
            server = TimedServer(share, 0, args.heads, args.kv_heads, args.head_dim, dtype, group,
                                 regions(args, device), 1)
            row["exchange_busy_iterations"] = busy.run_while(server.start())
            if server.error is not None:
                raise server.error
            row["lender_ms"] = summarize(server.records[warm:], LENDER_PARTS)
            rows.append(row)
    return rows


def regions(args: argparse.Namespace, device: torch.device) -> SharedRegions | None:
    """The engine's shared regions with ``--transport shm`` (sized for the largest ``--tokens``), else None."""
    if args.transport != "shm":
        return None
    return SharedRegions(region_prefix(args.scratch), max(args.tokens), device)


def _rank(rank: int, options: dict[str, Any], scratch: str) -> None:
    args = argparse.Namespace(**options, scratch=scratch)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # two processes of a few threads each on few cores
    if args.switch_interval and rank == 1:
        sys.setswitchinterval(args.switch_interval)
    dtype = getattr(torch, args.dtype)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=args.timeout))
    group = link.exchange_group(2)
    instrument("home" if rank == 0 else "lender")
    with torch.inference_mode():
        rows = (run_home if rank == 0 else run_lender)(args, device, dtype, group)
    Path(scratch, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def merge(home: list[dict[str, Any]], lender: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [h | {key: value for key, value in lr.items() if key not in h} for h, lr in zip(home, lender, strict=True)]


HOME_PARTS = ("pack", "d2h", "alloc", "send", "wait", "h2d", "other")
LENDER_PARTS = ("recv_wait", "recv", "alloc", "h2d", "attend", "attend_sync", "d2h", "send", "other", "answer")


def table(rows: list[dict[str, Any]]) -> str:
    """The three tables: per (tokens, busy mode), milliseconds at p50 (the round trip's p90 too)."""

    def p50(part: dict[str, dict[str, float]], name: str) -> str:
        return f"{part.get(name, {}).get('p50', 0.0):9.3f}"

    lines = ["exchange per layer (ms, p50): the round trip against the bare transport and the attention alone",
             f"{'tokens':>7} {'busy':>6} {'KiB out':>9} {'KiB back':>9} {'pingpong':>9} {'inproc':>9} {'launch':>9}"
             f" {'rt p50':>9} {'rt p90':>9} {'rt-pp-in':>9}"]
    for row in rows:
        home = row["home_ms"]
        rt, pp, attend = home["round_trip"], row["pingpong_ms"], row["inproc_ms"]["attend"]
        lines.append(f"{row['tokens']:>7} {row['busy']:>6} {row['payload_bytes'] / 1024:9.1f} "
                     f"{row['reply_bytes'] / 1024:9.1f} {pp['p50']:9.3f} {attend['p50']:9.3f} "
                     f"{row['inproc_ms']['launch']['p50']:9.3f} {rt['p50']:9.3f} {rt['p90']:9.3f} "
                     f"{rt['p50'] - pp['p50'] - attend['p50']:9.3f}")
    lines += ["", "home's parts (ms, p50)", f"{'tokens':>7} {'busy':>6}" + "".join(f" {n:>9}" for n in HOME_PARTS)]
    for row in rows:
        lines.append(f"{row['tokens']:>7} {row['busy']:>6}" + "".join(f" {p50(row['home_ms'], n)}" for n in HOME_PARTS))
    lines += ["", "lender's parts (ms, p50; answer: the call less recv_wait)",
              f"{'tokens':>7} {'busy':>6}" + "".join(f" {n[:9]:>9}" for n in LENDER_PARTS)]
    for row in rows:
        lines.append(f"{row['tokens']:>7} {row['busy']:>6}"
                     + "".join(f" {p50(row['lender_ms'], n)}" for n in LENDER_PARTS))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPUs, float32 on the CPU")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="query tokens per call (default: 1 64 4096; 1 64 on the CPU)")
    parser.add_argument("--lent-tokens", type=int, default=None,
                        help="context in the lender's share (default: 131072; 2048 on the CPU)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="measured steps (of --layers calls each)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before those measured")
    parser.add_argument("--busy-lender", nargs="+", choices=("none", "python", "prep", "gpu"), default=None,
                        help="the lender's main thread meanwhile (default: all; gpu only on GPUs)")
    parser.add_argument("--busy-matmul", type=int, nargs=3, default=None, metavar=("ROWS", "HIDDEN", "INTER"),
                        help="the gpu mode's GEMM (default: 2048 4096 14336, the 8B MLP's; 16 64 128 on the CPU)")
    parser.add_argument("--busy-matmuls", type=int, default=32, help="GEMMs of a gpu-mode step")
    parser.add_argument("--transport", choices=("shm", "gloo"), default="shm",
                        help="where q, k, v and the answers travel in the exchange (the engine's "
                             "VLLM_ACTORS_BORROW_TRANSPORT; the ping-pong is always gloo's)")
    parser.add_argument("--switch-interval", type=float, default=0.0,
                        help="the lender's sys.setswitchinterval in seconds (0: Python's, 0.005)")
    parser.add_argument("--cpu", action="store_true", help="on the CPU even with 2 GPUs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds before both processes are killed")
    parser.add_argument("--out", default="results/kv_borrow_exchange.json")
    args = parser.parse_args(argv)
    gpus = not args.cpu and torch.cuda.is_available() and torch.cuda.device_count() >= 2
    args.device = "cuda" if gpus else "cpu"
    args.dtype = args.dtype or ("bfloat16" if gpus else "float32")
    args.tokens = args.tokens or ([1, 64, 4096] if gpus else [1, 64])
    args.lent_tokens = args.lent_tokens or (131072 if gpus else 2048)
    args.lent_blocks = -(-args.lent_tokens // args.block_size)
    args.busy_lender = args.busy_lender or (["none", "python", "prep", "gpu"] if gpus else ["none", "python", "prep"])
    args.busy_matmul = args.busy_matmul or ([2048, 4096, 14336] if gpus else [16, 64, 128])
    return args


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    args = parse_args(argv)
    print(f"kv borrow exchange on {args.device}: {args.layers} layers, {args.heads}/{args.kv_heads} heads x "
          f"{args.head_dim}, {args.dtype}, {args.lent_blocks} lent blocks of {args.block_size}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvx-") as scratch:
        context = mp.start_processes(_rank, args=(vars(args), scratch), nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + args.timeout
        try:
            while not context.join(timeout=0.2):  # raises where a rank failed (and ends the other)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks ran past {args.timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=5)
        home, lender = (json.loads(Path(scratch, f"rank{rank}.json").read_text()) for rank in (0, 1))
    rows = merge(home, lender)
    print(table(rows))
    report = {"device": args.device, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
              "head_dim": args.head_dim, "dtype": args.dtype, "block_size": args.block_size,
              "lent_tokens": args.lent_blocks * args.block_size, "steps": args.steps, "warmup": args.warmup,
              "busy_matmul": args.busy_matmul, "busy_matmuls": args.busy_matmuls,
              "switch_interval": args.switch_interval or sys.getswitchinterval(), "transport": args.transport,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
