"""The weight-only FP8 GEMV's launches from the tuned tables (``kernels/fp8_gemv_config.py``, a ``gemv``
object per table of ``kernels/fp8_gemm_config.py``): an entry is chosen for its shape at the nearest
row count, by ``fp8_gemv`` and ``fp8_linear``, and gives the float64 reference (Triton's interpreter);
a bad entry is a clear error at load, a launch the kernel cannot take falls back to the default; the
sweep's table (``benchmarks/lib/fp8_gemv_sweep.py``, ``fp8_gemm_sweep.tuned_file``) carries both
kernels' launches, merged over the file it is written to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from benchmarks.lib import fp8_gemm_sweep, fp8_gemv_sweep

from vllm_actors.kernels import fp8_gemm, fp8_gemm_config, fp8_gemv
from vllm_actors.kernels.fp8_gemm_config import GemmLaunch
from vllm_actors.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fp8_gemm.HAVE_TRITON, reason="needs triton")
H100 = "NVIDIA H100 80GB HBM3"
N, K, BLOCK = 72, 88, (32, 16)  # a partial last row of blocks; K of 5.5 groups
ONE = Fp8GemvConfig(block_n=32, block_k=64, warps=2, stages=3, prefetch=1, tiles=2)  # not the default's
TWO = Fp8GemvConfig(block_n=16, block_k=32, warps=4, stages=1, prefetch=0, tiles=1)


def _problem(rows: int, seed: int, block: tuple[int, int] | None = BLOCK) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w, s = fp8_gemm.quantize_weight(torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen), block)
    return (torch.randn(rows, K, generator=gen) * 2).to(DEVICE), w.to(DEVICE), s.to(DEVICE)


def _table_file(path: Path, tables: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"format": fp8_gemm_config.FORMAT, "tables": tables}))
    return path


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[Fp8GemvConfig]:
    """The launch parameters the GEMV kernel runs with, as configs (tiles and prefetch as given at one row)."""
    launched: list[Fp8GemvConfig] = []
    real = fp8_gemv._fp8_gemv_kernel

    class Spy:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kw: Any) -> Any:
                launched.append(Fp8GemvConfig(block_n=kw["BLOCK_N"], block_k=kw["BLOCK_K"], warps=kw["num_warps"],
                                              stages=kw["STAGES"], prefetch=kw["PREFETCH"], tiles=kw["TILES"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(fp8_gemv, "_fp8_gemv_kernel", Spy())
    return launched


def test_table_entry_chosen_for_shape_and_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One table (no GEMM launches) sets the GEMV's launch at 1 and 2 rows; 3 and 4 take the nearest
    (2); other shapes, blocks and the GEMM keep their defaults; the result is the float64 reference."""
    path = _table_file(tmp_path / "t.json", [fp8_gemm_config.table_json(N, K, BLOCK, "any", {}, gemv={1: ONE, 2: TWO})])
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM_CONFIG", str(path))
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMV_ROWS", "4")
    assert [fp8_gemm_config.choose_gemv(rows, N, K, BLOCK, "cpu") for rows in (1, 2, 3, 4)] == [ONE, TWO, TWO, TWO]
    assert fp8_gemm_config.choose_gemv(1, N, K, (16, 16), "cpu") is None
    assert fp8_gemm_config.choose_gemv(1, N, 2 * K, BLOCK, "cpu") is None
    assert fp8_gemm_config.choose_launch(8, N, K, BLOCK, "cpu") == fp8_gemm_config.default_launch(8)
    launched = _launches(monkeypatch)
    for rows in (1, 3):
        x, w, s = _problem(rows, seed=rows)
        out = fp8_gemm.fp8_linear(x, w, s, BLOCK)  # its GEMV branch
        torch.testing.assert_close(out.double(), fp8_gemv_reference(x, w, s, BLOCK), rtol=1e-5, atol=1e-5)
    assert launched == [ONE, TWO]  # at 3 rows: TWO's, one tile a step, none before the wait
    x, w, s = _problem(1, seed=5)
    torch.testing.assert_close(fp8_gemv.fp8_gemv(x, w, s, BLOCK).double(), fp8_gemv_reference(x, w, s, BLOCK),
                               rtol=1e-5, atol=1e-5)
    assert launched[-1] == ONE


def test_launch_the_kernel_cannot_take_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch whose columns would straddle two rows of scale blocks (32 columns, blocks of 16 rows)
    is never run: the default runs instead, and gives the reference."""
    monkeypatch.setattr(fp8_gemm_config, "choose_gemv", lambda *args: ONE)
    launched = _launches(monkeypatch)
    x, w, s = _problem(1, seed=8, block=(16, 16))
    assert not fp8_gemv.takes(w, s, (16, 16), ONE) and fp8_gemv.choose_config(1, w, s, (16, 16)) == Fp8GemvConfig()
    torch.testing.assert_close(fp8_gemv.fp8_gemv(x, w, s, (16, 16)).double(), fp8_gemv_reference(x, w, s, (16, 16)),
                               rtol=1e-5, atol=1e-5)
    assert launched == [Fp8GemvConfig()]
    x, w, s = _problem(2, seed=9, block=None)  # a scale per channel takes any columns per program
    assert fp8_gemv.choose_config(2, w, s, None) == ONE


def _gemv_table(gemv: object, block: list[int] | None = [32, 16]) -> dict[str, Any]:  # noqa: B006 - read only
    return {"format": fp8_gemm_config.FORMAT, "tables": [{"n": 8, "k": 8, "block": block, "device": "any",
                                                          "gemv": gemv}]}


@pytest.mark.parametrize(("raw", "message"), [
    (_gemv_table({"1": {"block_n": 64, "block_k": 64}}), "block_n is 64: must divide the scale block's 32 rows"),
    (_gemv_table({"1": {"block_n": 16, "block_k": 64, "tiles": 3}}), "tiles must be 1 or 2"),
    (_gemv_table({"1": {"block_n": 16, "block_k": 48}}), "powers of two"),
    (_gemv_table({"1": {"block_n": 16, "block_k": 64, "warps": 3}}), "warps is 3"),
    (_gemv_table({"1": {"block_n": 16, "block_k": 64, "stages": 0}}), "stages is 0"),
    (_gemv_table({"1": {"block_n": 16, "block_k": 64, "tiles": True}}), "whole number"),
    (_gemv_table({"1": {"block_n": 16}}), "block_n, block_k required"),
    (_gemv_table({"1": {"block_n": 16, "block_k": 64, "group_m": 1}}), "keys among"),
    (_gemv_table({"5": {"block_n": 16, "block_k": 64}}), r"row counts must be 1..4"),
    (_gemv_table({"0": {"block_n": 16, "block_k": 64}}), r"gemv key '0'"),
    (_gemv_table({}), r"tables\[0\].gemv must be a non-empty object"),
    ({"format": fp8_gemm_config.FORMAT, "tables": [{"n": 8, "k": 8, "block": None, "device": "any"}]},
     r"configs \(or gemv"),
])
def test_bad_gemv_entries_are_clear_errors(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fp8_gemm_config.parse_file(json.dumps(raw), "t.json")


def test_shipped_tables_still_read() -> None:
    """The shipped GEMM tables (no ``gemv``) keep their launches; the GEMV keeps its default there."""
    assert fp8_gemm_config.tuned_table(6144, 4096, (128, 128), H100) is not None
    assert fp8_gemm_config.tuned_gemv_table(6144, 4096, (128, 128), H100) is None
    channel = fp8_gemm_config.parse_gemv_tables(json.dumps(_gemv_table({"2": {"block_n": 64, "block_k": 64}}, None)),
                                                "t")
    assert channel == {(8, 8, "channel", "any"): {2: Fp8GemvConfig(block_n=64, block_k=64)}}


def test_sweep_table_carries_both_kernels(tmp_path: Path) -> None:
    """The file ``--sweep-gemv --table-out`` writes: the GEMV's best per shape and rows over the file's
    own entries (its other shapes kept), the GEMM's launches merged in from the engine's tables, all
    read back by the engine as written."""
    qkv = (6144, 4096, "128x128", H100)
    old_one = Fp8GemvConfig(block_n=16, block_k=512)
    existing = [fp8_gemm_config.table_json(6144, 4096, (128, 128), H100, {}, source="old", gemv={1: old_one, 4: TWO}),
                fp8_gemm_config.table_json(77, 512, (128, 128), H100, {16: GemmLaunch(16, 64)}, source="kept")]
    path = _table_file(tmp_path / "t.json", existing)
    read = fp8_gemm_sweep.existing_tables(str(path), merge=True)
    assert read == existing and fp8_gemm_sweep.existing_tables(str(tmp_path / "none.json"), merge=True) is None
    tuned = fp8_gemm_sweep.tuned_file({}, H100, merge=True, source="test", gemv={(6144, 4096): {1: ONE, 2: TWO},
                                                                                 (4096, 4096): {1: TWO}},
                                      existing=read)
    gemm, gemv = fp8_gemm_config.parse_file(fp8_gemm_config.dumps(tuned), "sweep")
    assert gemv[qkv] == {1: ONE, 2: TWO, 4: TWO} and gemv[(4096, 4096, "128x128", H100)] == {1: TWO}
    assert gemm[qkv] == fp8_gemm_config.tuned_table(6144, 4096, (128, 128), H100)  # the shipped GEMM launches
    assert gemm[(77, 512, "128x128", H100)] == {16: GemmLaunch(16, 64)} and (77, 512, "128x128", H100) not in gemv
    alone = fp8_gemm_config.parse_file(json.dumps(fp8_gemm_sweep.tuned_file(
        {}, H100, merge=False, source="t", gemv={(6144, 4096): {1: ONE}}, existing=read)), "t")
    assert alone == ({}, {qkv: {1: ONE}})
    bad = _table_file(tmp_path / "bad.json", [{"n": 8, "k": 8, "block": None, "device": "any"}])
    with pytest.raises(ValueError, match="configs"):  # refused before a sweep spends its time
        fp8_gemm_sweep.existing_tables(str(bad), merge=True)


def test_sweep_checks_times_and_picks_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each candidate is checked against the default launch's output, then timed (faked: no GPU); a
    wrong one is left out, the fastest is the table's. The grid: float8-sized launches, the default
    first, each dividing Qwen3's 128-row scale blocks, one tile a step above one row."""
    grid = fp8_gemv_sweep.candidates(1)
    assert grid[0] == Fp8GemvConfig() and 30 <= len(grid) <= 40 and all(128 % c.block_n == 0 for c in grid)
    assert {c.block_n for c in grid} == {8, 16, 32} and {c.stages for c in grid} == {2, 3, 4}
    assert all(c.tiles == 1 for c in fp8_gemv_sweep.candidates(2)) and len(fp8_gemv_sweep.candidates(2)) < len(grid)
    few = [Fp8GemvConfig(), ONE, TWO]
    monkeypatch.setattr(fp8_gemv_sweep, "candidates", lambda rows: few)
    x, w, s = _problem(1, seed=11)
    checks: list[int] = []
    timings = [9.0, 1.0]  # the default's, then TWO's (ONE is "wrong" below, never timed)

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        checks.append(1)
        return len(checks) != 2

    def time_fn(fn: Any) -> float:
        assert fn((w, s)).shape == (1, N)  # it runs the launch it times
        return timings.pop(0)

    row, best = fp8_gemv_sweep.sweep_gemv(x, [(w, s)], BLOCK, time_fn, close)
    assert len(checks) == 3 and not timings and row["gemv_wrong"] == [fp8_gemv_sweep.key(ONE)] and best == TWO
    assert set(row["gemv_sweep_us"]) == {fp8_gemv_sweep.key(Fp8GemvConfig()), fp8_gemv_sweep.key(TWO)}
    assert row["gemv_default_us"] == 9.0 and row["gemv_best_us"] == 1.0 and row["gemv_best"] == TWO.to_json()


def test_the_gemv_sweeps_main_checks_the_table_file_before_timing(tmp_path: Path) -> None:
    """``benchmarks/fp8_gemm.py --sweep-gemv --table-out FILE`` reads FILE before any timing: an unreadable
    one is the engine's clear ValueError (it once failed there with an UnboundLocalError on the GPU)."""
    from benchmarks.lib import fp8_gemm_bench

    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        fp8_gemm_bench.main(["--sweep-gemv", "--rows", "1", "--table-out", str(bad), "--out", str(tmp_path / "o.json")])
