"""The batch-1 long-context decode sweep's summary (`benchmarks/lib/decode_long.py`; the timing
itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib.decode_long import Cell, parse_args, programs_per_sm, summary


def _cell(kv: str, tiles: str, splits: int, us: float, engine: bool, chosen: bool) -> Cell:
    return Cell("qwen3-8b", 131072, kv, tiles, splits, 128, 4, 2, us, 1.0, 100.0 / us, engine, chosen)


def test_the_summary_sets_each_fp8_variant_against_the_bf16_engine_choice() -> None:
    cells = [
        _cell("bfloat16", "-", 64, 100.0, True, True), _cell("bfloat16", "-", 32, 95.0, False, False),
        _cell("fp8", "query", 64, 80.0, True, False),  # the engine's choice before the fp16 tiles
        _cell("fp8", "float16", 64, 55.0, True, True), _cell("fp8", "float16", 32, 50.0, False, False),
    ]  # fmt: skip
    header, bf16, fp16, query = summary(cells)
    assert header.startswith("shape context")
    assert bf16.startswith("qwen3-8b 131072 bfloat16/-: 100.0") and "s32" in bf16
    assert fp16.startswith("qwen3-8b 131072 fp8/float16 (the engine's): 55.0 (1.818)")
    assert fp16.endswith("| 1.82x engine, 2.00x best")
    assert query.startswith("qwen3-8b 131072 fp8/query: 80.0") and query.endswith("1.25x engine, 1.25x best")
    assert parse_args([]).fp8_tiles == ["query", "float16"]


def test_programs_a_sm_holds_by_registers_shared_memory_and_warps() -> None:
    """The sm_90 builds of the decode kernel (registers from ptxas, shared bytes from Triton): the fp8
    cache's fp16 tiles at head_dim 128 hold two programs a SM where the bf16 cache's hold five."""
    assert programs_per_sm(198, 40960, 4) == 2  # fp8, head_dim 128: registers bound
    assert programs_per_sm(135, 22528, 4) == 3  # fp8, head_dim 64
    assert programs_per_sm(85, 38912, 4) == 5  # bf16, head_dim 64: shared memory and registers
    assert programs_per_sm(32, 200_000, 4) == 1  # shared memory bound
    assert programs_per_sm(16, 0, 8) == 8  # warps bound (64 a SM)
    assert programs_per_sm(0, 0, 4) == 0  # not known
    assert parse_args([]).max_registers == [0]
