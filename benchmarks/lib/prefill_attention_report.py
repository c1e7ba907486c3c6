"""The prefill-attention benchmark's report (``benchmarks.lib.prefill_attention``): the threshold each
shape's measurements give the ``auto`` rule, and markdown tables of TFLOP/s and ms."""

from __future__ import annotations

from collections import defaultdict

from benchmarks.lib.prefill_attention import SHAPES, Case


def crossover(cases: list[Case]) -> int | None:
    """The shortest chunk from which flash-attn was faster at every context, for that chunk and every
    longer one (the grid cases of one shape and block size). None: never, or not measured."""
    by_chunk: dict[int, list[float]] = defaultdict(list)
    for case in cases:
        if case.kind == "grid" and case.speedup is not None:
            by_chunk[case.chunk].append(case.speedup)
    threshold = None
    for chunk in sorted(by_chunk, reverse=True):
        if min(by_chunk[chunk]) <= 1.0:
            break
        threshold = chunk
    return threshold


def thresholds(cases: list[Case]) -> dict[str, dict[int, int | None]]:
    """crossover per shape and block size."""
    groups: dict[tuple[str, int], list[Case]] = defaultdict(list)
    for case in cases:
        groups[(case.shape, case.block_size)].append(case)
    found: dict[str, dict[int, int | None]] = defaultdict(dict)
    for (shape, block_size), group in sorted(groups.items()):
        found[shape][block_size] = crossover(group)
    return dict(found)


def suggested_rule(found: dict[str, dict[int, int | None]], block_size: int = 16) -> str:
    """``kernels/prefill_choice.py``'s ``FLASH_ATTN_MIN_QUERY_LEN`` as these thresholds give it at the
    engine's block size (a head_dim where flash-attn never won gets a threshold above every chunk)."""
    rule = {}
    for shape, by_block in sorted(found.items(), key=lambda item: SHAPES[item[0]][2]):
        if block_size in by_block:
            threshold = by_block[block_size]
            rule[SHAPES[shape][2]] = threshold if threshold is not None else 1 << 30
    return f"FLASH_ATTN_MIN_QUERY_LEN: dict[int, int] = {rule}"


def _cell(case: Case) -> str:
    tri = case.tflops.get("triton")
    fa = case.tflops.get("flash_attn")
    if fa is None:
        return f"{tri:.0f}" if tri is not None else "-"
    return f"{tri:.0f} / {fa:.0f} ({case.speedup:.2f}x)"


def _kib(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def markdown(cases: list[Case], title: str) -> str:
    """One table per shape and block size: contexts down, chunks across, cells 'Triton / flash-attn
    TFLOP/s (speedup)'; then the long-context and mixed cases with their ms."""
    lines = [f"# Prefill attention: Triton varlen vs flash-attn 4\n\n{title}\n"]
    groups: dict[tuple[str, int], list[Case]] = defaultdict(list)
    for case in cases:
        groups[(case.shape, case.block_size)].append(case)
    for (shape, block_size), group in sorted(groups.items()):
        grid = [c for c in group if c.kind == "grid"]
        chunks = sorted({c.chunk for c in grid})
        contexts = sorted({c.context for c in grid})
        by_key = {(c.context, c.chunk): c for c in grid}
        lines.append(f"## {shape}, block size {block_size}: TFLOP/s, Triton / flash-attn (speedup)\n")
        lines.append("| context \\ chunk | " + " | ".join(_kib(c) for c in chunks) + " |")
        lines.append("| --- |" + " --- |" * len(chunks))
        for context in contexts:
            cells = [_cell(by_key[(context, chunk)]) if (context, chunk) in by_key else "" for chunk in chunks]
            lines.append(f"| {_kib(context)} | " + " | ".join(cells) + " |")
        lines.append(f"\nflash-attn faster from chunk: {crossover(group)}\n")
        others = [c for c in group if c.kind != "grid"]
        if others:
            lines.append("| context | chunk | decodes | Triton ms | flash-attn ms | Triton / flash-attn TFLOP/s |")
            lines.append("| --- | --- | --- | --- | --- | --- |")
            for c in others:
                decodes = f"{c.decodes} x {_kib(c.decode_context)}" if c.decodes else "-"
                ms = [f"{c.ms[k]:.3f}" if k in c.ms else "-" for k in ("triton", "flash_attn")]
                lines.append(f"| {_kib(c.context)} | {_kib(c.chunk)} | {decodes} | {ms[0]} | {ms[1]} | {_cell(c)} |")
            lines.append("")
    return "\n".join(lines)
