"""The fused MoE kernel's tiles per batch size (`kernels/moe_config.py`), one GPU.

    python benchmarks/moe_sweep.py [--tokens 1 2 4 ... 4096] [--skew zipf:1.2 ...] [--tp 1]
        [--out $OUT/moe_sweep] [--table-out PATH] [--no-merge]

At Qwen3-30B-A3B's expert shapes (E 128, top-8, hidden 2048, moe_intermediate 768 / TP) in bfloat16,
for each token count and for uniform and each Zipf-skewed routing (``models/router_skew.py``'s table),
times each GEMM (gate_up: N = 2 x 768 over K = 2048 with SiLU-and-mul; down: N = 2048 over K = 768)
for every candidate of a bounded grid (BLOCK_M from the mean rows per expert up to the hottest
expert's rows, since each row block re-reads its expert's weights; BLOCK_N, BLOCK_K, warps, stages
per BLOCK_M; those over SM90's shared memory left out), each call replayed from a CUDA graph cycling
through weight copies that together defeat L2. Every candidate's output is checked against the
built-in config's. Per token count the BLOCK_M whose best gate_up + best down time, summed over the
routings, is least wins. Written to ``--out``: ``moe_sweep.json`` (every timing), ``moe_sweep.md``
(per token count and routing: the winner's and the current config's times, TFLOP/s, and GB/s against
the weights of the experts actually routed to) and ``moe_configs/<shape>.json``: the table the engine
reads (the current table's entries at the token counts not swept, unless ``--no-merge``), to commit
into ``src/vllm_actors/kernels/moe_configs/`` or to name in ``VLLM_ACTORS_MOE_CONFIG``
(``benchmarks/throughput.py --moe-config``); ``--table-out`` copies it to a fixed path. About 150-200 s
on an H100 for every token count (mostly ~100 Triton compiles); ``--budget-s`` stops adding token
counts past it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.kernels_timing import do_bench_graph, spin_up

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
WEIGHT_BYTES_IN_FLIGHT = 3 << 30  # weight copies cycled per graph: well past L2
# (block_n, block_k, warps, stages) per BLOCK_M; GROUP_M 1 where experts hold one or two row blocks, else 8
TILES = {
    16: [(n, k, 4, s) for n in (32, 64, 128) for k in (128, 256) for s in (3, 4, 5)],
    32: [(n, k, 4, s) for n in (64, 128) for k in (64, 128) for s in (3, 4)],
    64: [(n, k, w, s) for n in (64, 128) for k in (64, 128) for w in (4, 8) for s in (3, 4)],
    128: [(n, 64, 8, s) for n in (64, 128) for s in (3, 4)],
}
GROUP_M = {16: 1, 32: 1, 64: 8, 128: 8}


def block_ms(tokens: int, hot_rows: int) -> list[int]:
    """BLOCK_M candidates by the mean rows per expert r and the hottest expert's rows h (the most any
    routing swept gives one expert): up to max(2r, h) (at least 16), at least r / 4 (at most 64)."""
    rows = tokens * TOP_K / EXPERTS
    return [m for m in TILES if m <= max(16, 2 * rows, hot_rows) and 4 * m >= min(rows, 256)]


def candidates(block_m: int, gate_up: bool) -> list[Any]:
    from vllm_actors.kernels.moe_config import SHARED_BYTES, GemmTiles, shared_bytes

    out = []
    for n, k, warps, stages in TILES[block_m]:
        tiles = GemmTiles(n, k, GROUP_M[block_m], warps, stages)
        accumulators = block_m * n * (2 if gate_up else 1) / (warps * 32)  # float32 registers a thread holds
        if shared_bytes(block_m, tiles, gate_up, 2) <= SHARED_BYTES and accumulators <= 128:
            out.append(tiles)
    return out


def routings(tokens: int, skews: list[str], device: str = "cuda") -> dict[str, torch.Tensor]:
    """Expert ids [tokens, k]: uniform draws, and each skew's table rows as the engine's first layer takes them."""
    from vllm_actors.models.router_skew import make_table, parse_skew, skewed_logits

    gen = torch.Generator(device=device).manual_seed(tokens)
    out = {"uniform": torch.rand((tokens, EXPERTS), generator=gen, device=device).topk(TOP_K, dim=-1).indices}
    for skew in skews:
        table = make_table(parse_skew(skew), EXPERTS, device)
        out[parse_skew(skew).spec] = skewed_logits(table, tokens, 0, torch.float32).topk(TOP_K, dim=-1).indices
    return out


def hottest_rows(ids: dict[str, torch.Tensor]) -> int:
    """The most rows one expert gets under any of the routings."""
    return max(int(torch.bincount(i.reshape(-1), minlength=EXPERTS).max()) for i in ids.values())


def merged_table(swept: dict[str, Any], current: dict[int, Any] | None) -> dict[str, Any]:
    """The swept entries over the current table's (token count -> config JSON), by token count."""
    table = {str(tokens): config.to_json() for tokens, config in (current or {}).items()}
    table.update(swept)
    return dict(sorted(table.items(), key=lambda item: int(item[0])))


def default_out() -> str:
    """``$OUT/moe_sweep`` where the GPU session names its output folder, else ``results/moe_sweep``."""
    return str(Path(os.environ.get("OUT", "results")) / "moe_sweep")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got.float() - want.float()).norm()) <= 1e-2 * float(want.float().norm()) + 1e-6


def main(argv: list[str] | None = None) -> int:
    from vllm_actors.kernels import fused_moe, moe_config
    from vllm_actors.kernels.moe_align import moe_align_block_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--tp", type=int, default=1, help="the intermediate size is 768 / tp")
    parser.add_argument("--skew", nargs="+", default=["zipf:1.2"],
                        help="the skewed routings timed beside uniform (models/router_skew.py)")
    parser.add_argument("--out", default=default_out())
    parser.add_argument("--table-out", default=None, help="also write the table here (for --moe-config)")
    parser.add_argument("--no-merge", action="store_true",
                        help="the table holds the swept token counts alone (default: over the current table)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="no new token count past this")
    parser.add_argument("--warmup-ms", type=float, default=1.0)
    parser.add_argument("--rep-ms", type=float, default=5.0)
    args = parser.parse_args(argv)
    began = time.monotonic()
    inter = INTER // args.tp
    shape = moe_config.MoeShape(EXPERTS, HIDDEN, inter, TOP_K)
    dtype, device_name = torch.bfloat16, torch.cuda.get_device_name()
    spin_up()
    copies = max(2, -(-WEIGHT_BYTES_IN_FLIGHT // (EXPERTS * 3 * HIDDEN * inter * 2)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13s = [(0.02 * torch.randn((EXPERTS, 2 * inter, HIDDEN), generator=gen, device="cuda")).to(dtype)
            for _ in range(copies)]
    w2s = [(0.02 * torch.randn((EXPERTS, HIDDEN, inter), generator=gen, device="cuda")).to(dtype)
           for _ in range(copies)]

    def timed(fn: Any) -> float:  # us per call, each call on the next weight copy
        turn = itertools.cycle(range(copies))
        return do_bench_graph(lambda: fn(next(turn)), args, calls=2 * copies) * 1e3

    current_table = moe_config.tuned_table(shape, "bfloat16", device_name)  # what the engine reads now
    results: list[dict[str, Any]] = []
    table: dict[str, Any] = {}
    skipped: list[int] = []
    for tokens in args.tokens:
        if time.monotonic() - began > args.budget_s:
            skipped.append(tokens)
            continue
        x = torch.randn((tokens, HIDDEN), generator=gen, device="cuda").to(dtype)
        default = moe_config.default_config(tokens, shape)
        current = moe_config.choose_config(tokens, shape, "bfloat16", device_name)
        per_bm: dict[int, float] = {}
        best_tiles: dict[tuple[int, str], Any] = {}
        cases: dict[str, Any] = {}
        ids_by_routing = routings(tokens, args.skew)
        sizes = sorted(set(block_ms(tokens, hottest_rows(ids_by_routing))) | {default.block_m, current.block_m})
        for name, ids in ids_by_routing.items():
            weights = torch.softmax(torch.randn((tokens, TOP_K), device="cuda"), -1).reshape(-1)
            ref_blocks = moe_align_block_size(ids, default.block_m, EXPERTS, use_triton=True)
            ref_act = fused_moe.moe_gate_up(x, w13s[0], ref_blocks, TOP_K, default.gate_up)
            ref_out = fused_moe.moe_down(ref_act, w2s[0], weights, ref_blocks, default.down)
            experts_read = int(ids.unique().numel())
            cases[name] = {"ids": ids, "weights": weights, "act": ref_act, "experts_read": experts_read,
                           "hottest_rows": hottest_rows({name: ids})}
            for bm in sizes:
                blocks = moe_align_block_size(ids, bm, EXPERTS, use_triton=True)
                for gemm in ("gate_up", "down"):
                    own = [getattr(c, gemm) for c in (default, current) if c.block_m == bm]
                    for tiles in dict.fromkeys(candidates(bm, gemm == "gate_up") + own):
                        if gemm == "gate_up":
                            run = lambda c, b=blocks, t=tiles, x=x: fused_moe.moe_gate_up(x, w13s[c], b, TOP_K, t)  # noqa: E731
                            ok = _close(run(0), ref_act)
                        else:
                            run = lambda c, b=blocks, t=tiles, w=weights, a=ref_act: fused_moe.moe_down(  # noqa: E731
                                a, w2s[c], w, b, t)
                            ok = _close(run(0), ref_out)
                        if not ok:
                            raise SystemExit(f"{gemm} {tiles} at BLOCK_M {bm}, {tokens} tokens ({name}): output "
                                             "differs from the built-in config's")
                        us = timed(run)
                        results.append({"tokens": tokens, "routing": name, "gemm": gemm, "block_m": bm,
                                        "tiles": tiles.__dict__, "us": us, "experts_read": experts_read})
        # the winner: per BLOCK_M the tiles least in time summed over the routings, per GEMM
        for bm in sizes:
            total = 0.0
            for gemm in ("gate_up", "down"):
                sums: dict[str, float] = {}
                for row in results:
                    if row["tokens"] == tokens and row["block_m"] == bm and row["gemm"] == gemm:
                        key = json.dumps(row["tiles"], sort_keys=True)
                        sums[key] = sums.get(key, 0.0) + row["us"]
                best = min(sums, key=sums.__getitem__)
                best_tiles[(bm, gemm)] = moe_config.GemmTiles(**json.loads(best))
                total += sums[best]
            per_bm[bm] = total
        bm = min(per_bm, key=per_bm.__getitem__)
        chosen = moe_config.MoeConfig(bm, best_tiles[(bm, "gate_up")], best_tiles[(bm, "down")])
        table[str(tokens)] = chosen.to_json()
        for name, case in cases.items():  # the whole op, alignment and sum included: chosen vs current
            topk_w = case["weights"].view(tokens, TOP_K)
            for label, config in (("chosen", chosen), ("current", current)):
                case[f"{label}_us"] = timed(lambda c, cfg=config, ids=case["ids"], w=topk_w, x=x: (
                    fused_moe.fused_moe_triton(x, w13s[c], w2s[c], w, ids, config=cfg)))
            results.append({"tokens": tokens, "routing": name, "gemm": "fused_moe", "chosen_us": case["chosen_us"],
                            "current_us": case["current_us"], "current_block_m": current.block_m,
                            "current_gate_up": current.gate_up.__dict__, "current_down": current.down.__dict__,
                            "experts_read": case["experts_read"], "hottest_rows": case["hottest_rows"]})
        print(f"{tokens:5d} tokens ({time.monotonic() - began:5.0f} s): {chosen}  "
              + "  ".join(f"{n}: {c['chosen_us']:.1f} us (current {c['current_us']:.1f})" for n, c in cases.items()),
              flush=True)
    _write(args, shape, device_name, merged_table(table, None if args.no_merge else current_table), results,
           skipped)
    return 0


def _write(args: argparse.Namespace, shape: Any, device_name: str, table: dict[str, Any],
           results: list[dict[str, Any]], skipped: list[int]) -> None:
    from vllm_actors.kernels import moe_config

    out = Path(args.out)
    (out / "moe_configs").mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    tuned = {"format": moe_config.FORMAT, "tables": [{
        "shape": {"experts": shape.experts, "hidden": shape.hidden, "intermediate": shape.intermediate,
                  "top_k": shape.top_k}, "dtype": "bfloat16", "device": device_name, "configs": table}]}
    name = f"e{shape.experts}_h{shape.hidden}_i{shape.intermediate}_k{shape.top_k}_bfloat16_{slug}.json"
    (out / "moe_configs" / name).write_text(json.dumps(tuned, indent=1) + "\n")
    moe_config.parse_tables((out / "moe_configs" / name).read_text(), name)  # what the chooser will read
    (out / "moe_sweep.json").write_text(json.dumps({"device": device_name, "shape": shape.key(), "skew": args.skew,
                                                     "skipped_tokens": skipped, "results": results}, indent=1))
    lines = ["| tokens | routing | experts read | hottest expert's rows | GEMM | BLOCK_M | tiles | us | TFLOP/s | "
             "weight GB/s | current BLOCK_M | current us |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    swept = {r["tokens"] for r in results}
    for tokens, config in ((t, c) for t, c in table.items() if int(t) in swept):
        for routing in sorted({r["routing"] for r in results if r["tokens"] == int(tokens)}):
            rows = [r for r in results if r["tokens"] == int(tokens) and r["routing"] == routing]
            fused = next(r for r in rows if r["gemm"] == "fused_moe")
            for gemm, n, k in (("gate_up", 2 * shape.intermediate, shape.hidden),
                               ("down", shape.hidden, shape.intermediate)):
                tiles = config[gemm]
                mine = next(r for r in rows if r["gemm"] == gemm and r["block_m"] == config["block_m"]
                            and r["tiles"] == tiles)
                base = [r for r in rows if r["gemm"] == gemm and r["block_m"] == fused["current_block_m"]
                        and r["tiles"] == fused[f"current_{gemm}"]]
                flops = 2 * int(tokens) * shape.top_k * n * k
                read = mine["experts_read"] * n * k * 2
                lines.append(f"| {tokens} | {routing} | {mine['experts_read']} | {fused['hottest_rows']} | {gemm} | "
                             f"{config['block_m']} | {tiles['block_n']}x{tiles['block_k']} g{tiles['group_m']} "
                             f"w{tiles['warps']} s{tiles['stages']} | {mine['us']:.1f} | "
                             f"{flops / mine['us'] / 1e6:.1f} | {read / mine['us'] / 1e3:.0f} | "
                             f"{fused['current_block_m']} | {base[0]['us'] if base else float('nan'):.1f} |")
            lines.append(f"| {tokens} | {routing} | {fused['experts_read']} | {fused['hottest_rows']} | whole op | | | "
                         f"{fused['chosen_us']:.1f} | | | | {fused['current_us']:.1f} |")
    if skipped:
        lines.append(f"\nNot measured (past --budget-s {args.budget_s:g}): {skipped}")
    (out / "moe_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.table_out:
        Path(args.table_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table_out).write_text(json.dumps(tuned, indent=1) + "\n")
        print(f"the table is also at {args.table_out} (benchmarks/throughput.py --moe-config {args.table_out})")
    print(f"commit {out / 'moe_configs' / name} into src/vllm_actors/kernels/moe_configs/")
