"""The prefill-attention benchmark's arithmetic and report (`benchmarks/lib/prefill_attention*.py`;
the timing itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib.prefill_attention import Case, cases_for, causal_flops, parse_args
from benchmarks.lib.prefill_attention_report import crossover, markdown, suggested_rule, thresholds


def test_causal_flops_count_the_visible_pairs() -> None:
    # 3 new tokens over 2 cached: they see 3, 4 and 5 keys; a decode row over 7 sees 7
    assert causal_flops(2, 8, [3, 1], [5, 7]) == 4 * 2 * 8 * (3 + 4 + 5 + 7)


def _case(context: int, chunk: int, triton_ms: float, flash_ms: float, block_size: int = 16) -> Case:
    return Case("qwen3-8b", block_size, context, chunk, ms={"triton": triton_ms, "flash_attn": flash_ms},
                tflops={"triton": 1.0, "flash_attn": 2.0})


def test_the_threshold_is_the_shortest_chunk_won_at_every_context_from_there_up() -> None:
    cases = [
        _case(0, 256, 1.0, 2.0), _case(4096, 256, 1.0, 0.5),  # lost at context 0
        _case(0, 512, 1.0, 0.9), _case(4096, 512, 1.0, 0.5),
        _case(0, 1024, 1.0, 0.5), _case(4096, 1024, 1.0, 0.5),
        Case("qwen3-8b", 16, 4096, 128, 63, 4096, kind="mixed", ms={"triton": 1.0, "flash_attn": 0.1}),
    ]
    assert crossover(cases) == 512
    cases[2].ms["flash_attn"] = 1.1  # lost at 512 too: from 1024
    assert crossover(cases) == 1024
    assert crossover([_case(0, 8192, 1.0, 1.5)]) is None
    found = thresholds([*cases, _case(0, 256, 1.0, 0.5, block_size=128)])
    assert found == {"qwen3-8b": {16: 1024, 128: 256}}
    rule = suggested_rule({**found, "llama-3.2-1b": {16: None}})
    assert rule == "FLASH_ATTN_MIN_QUERY_LEN: dict[int, int] = {64: 1073741824, 128: 1024}"
    report = markdown(cases, "test")
    assert "| 4k | 1 / 2 (2.00x) | 1 / 2 (2.00x) | 1 / 2 (2.00x) |" in report
    assert "flash-attn faster from chunk: 1024" in report
    assert "| 4k | 128 | 63 x 4k |" in report


def test_the_default_cases_cover_the_issue_grid() -> None:
    args = parse_args([])
    assert set(args.shapes) == {"llama-3.2-1b", "qwen3-8b"} and set(args.block_sizes) == {16, 128}
    assert min(args.chunks) <= 512 and max(args.chunks) == 16384 and max(args.contexts) == 131072
    cases = cases_for("llama-3.2-1b", 16, args)
    assert {c.context for c in cases if c.kind == "long"} == {1 << 20}
    assert all(c.decodes == 63 for c in cases if c.kind == "mixed")
