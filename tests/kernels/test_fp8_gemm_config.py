"""The Triton FP8 GEMM's launches per weight shape and rows (``kernels/fp8_gemm_config.py``): launches
of odd tiles (one weight scale per tile or several) give the float64 reference on odd shapes
(Triton's interpreter on the CPU); a tuned table overrides the choice by rows at the nearest row
count, the shipped Qwen3 table parses, a bad table is a clear error, and the sweep's table
(``benchmarks/lib/fp8_gemm_sweep.py``) reads back as the launches it chose."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from benchmarks.lib import fp8_gemm_sweep

from vllm_actors.kernels import fp8_gemm, fp8_gemm_config
from vllm_actors.kernels.fp8_gemm_config import GemmLaunch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fp8_gemm.HAVE_TRITON, reason="needs triton")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(("launch", "block"), [
    (GemmLaunch(16, 32, 32, 2, 4, 2), (64, 32)),  # one weight scale per tile and K step
    (GemmLaunch(32, 64, 16, 1, 4, 1), (32, 64)),  # two weight scale blocks per tile; K step under the block
    (GemmLaunch(16, 16, 128, 3, 4, 1), (16, 32)),  # a K step of 128 capped at the scale block (32)
    (GemmLaunch(32, 32, 32, 2, 4, 2, tma=True), (64, 32)),  # tiles through tensor descriptors
    (GemmLaunch(16, 64, 16, 1, 4, 1, tma=True), (32, 64)),
], ids=["one_scale", "two_scales", "k_capped", "tma_one_scale", "tma_two_scales"])
def test_launches_against_float64(launch: GemmLaunch, block: tuple[int, int]) -> None:
    n, k, rows = 200, 160, 37  # partial row, column and K tiles
    gen = torch.Generator().manual_seed(launch.block_n)
    weight, scale = fp8_gemm.quantize_weight(torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen),
                                             block)
    x = (torch.randn(rows, k, generator=gen) * 2).to(DEVICE)
    weight, scale = weight.to(DEVICE), scale.to(DEVICE)
    out = fp8_gemm.fp8_linear(x, weight, scale, block, config=fp8_gemm.Fp8GemmConfig(launch=launch))
    x_q, x_s = fp8_gemm.quantize_activations(x, block[1])
    assert not launch.tma or fp8_gemm._tma_takes(x_q, weight)  # the descriptors' path ran
    torch.testing.assert_close(out.double(), fp8_gemm.fp8_linear_reference(x_q, x_s, weight, scale, block),
                               rtol=1e-5, atol=1e-5)


def test_default_launch_by_rows_and_shared_memory() -> None:
    assert fp8_gemm_config.default_launch(8).block_m == 16 and fp8_gemm_config.default_launch(4096).block_m == 64
    assert fp8_gemm_config.default_launch(100) == GemmLaunch(64, 64, 128, 32, 4, 3)
    big = fp8_gemm_config.fit_stages(GemmLaunch(256, 256, 128, 8, 8, 6))
    assert big.stages == 3 and fp8_gemm_config.shared_bytes(big) <= fp8_gemm_config.SHARED_BYTES
    # a shape no table holds takes the choice by rows
    assert fp8_gemm_config.choose_launch(300, 72, 80, (16, 16), "cpu") == fp8_gemm_config.default_launch(300)


def test_tuned_table_overrides_at_the_nearest_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small, large = GemmLaunch(16, 64, 128, 16, 4, 4), GemmLaunch(128, 128, 128, 8, 8, 3)
    tables = {"format": fp8_gemm_config.FORMAT, "tables": [
        fp8_gemm_config.table_json(72, 80, (16, 16), "any", {16: small, 2048: large})]}
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps(tables))
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM_CONFIG", str(path))
    assert fp8_gemm_config.choose_launch(8, 72, 80, (16, 16), "cpu") == small
    assert fp8_gemm_config.choose_launch(300, 72, 80, (16, 16), "cpu") == large  # log2: nearer 2048 than 16
    assert fp8_gemm_config.choose_launch(300, 72, 80, None, "cpu") == fp8_gemm_config.default_launch(300)


def test_shipped_qwen3_table() -> None:
    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5120, 2048), (2048, 4096)):
        table = fp8_gemm_config.tuned_table(n, k, (128, 128), H100)
        assert table is not None and min(table) == 2 and max(table) == 4096
        assert fp8_gemm_config.tuned_table(n, k, (128, 128), "another GPU") is None


@pytest.mark.parametrize(("raw", "message"), [
    ({"format": "x", "tables": []}, "need an object"),
    ({"format": fp8_gemm_config.FORMAT, "tables": [{"n": 8, "k": 8, "block": None, "device": "any"}]}, "needs n, k"),
    ({"format": fp8_gemm_config.FORMAT, "tables": [{"n": 8, "k": 8, "block": [128], "device": "any",
                                                    "configs": {"1": {"block_m": 16, "block_n": 16}}}]}, "block must"),
    ({"format": fp8_gemm_config.FORMAT, "tables": [{"n": 8, "k": 8, "block": None, "device": "any",
                                                    "configs": {"1": {"block_m": 48, "block_n": 16}}}]},
     "block_m is 48"),
    ({"format": fp8_gemm_config.FORMAT, "tables": [{"n": 8, "k": 8, "block": None, "device": "any",
                                                    "configs": {"0": {"block_m": 16, "block_n": 16}}}]}, "row count"),
])
def test_bad_tables_are_clear_errors(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fp8_gemm_config.parse_tables(json.dumps(raw), "t.json")


def test_sweep_table_round_trip() -> None:
    """The sweep's file parses back to its launches, merged over the shipped table's other rows."""
    best = {(6144, 4096): {2048: GemmLaunch(128, 128, 128, 32, 8, 4)}, (77, 512): {256: GemmLaunch(64, 256)}}
    tuned = fp8_gemm_sweep.tuned_file(best, H100, merge=True, source="test")
    tables = fp8_gemm_config.parse_tables(fp8_gemm_config.dumps(tuned), "sweep")  # the file --table-out writes
    qkv = tables[(6144, 4096, "128x128", H100)]
    assert qkv[2048] == GemmLaunch(128, 128, 128, 32, 8, 4)
    shipped = fp8_gemm_config.tuned_table(6144, 4096, (128, 128), H100)
    assert shipped is not None and qkv[16] == shipped[16]
    assert tables[(77, 512, "128x128", H100)] == {256: GemmLaunch(64, 256)}
    alone = fp8_gemm_config.parse_tables(json.dumps(fp8_gemm_sweep.tuned_file(best, H100, False, "t")), "t")
    assert alone[(6144, 4096, "128x128", H100)] == {2048: GemmLaunch(128, 128, 128, 32, 8, 4)}
    assert 20 <= len(fp8_gemm_sweep.candidates(2048)) <= 40
    assert not any(c.tma for c in fp8_gemm_sweep.candidates(2048, tma=False))
    assert all(c.block_m <= 32 for c in fp8_gemm_sweep.candidates(8))


def test_sweep_step_checks_then_times_each_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """One shape at one row count (the timer faked: a launch's time is how many were checked up to it,
    so the current launch, timed first, is the best): every candidate's output is checked against the
    current launch's, then timed, and the best one is what the table gets."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 128, generator=gen)
    fp8 = [fp8_gemm.quantize_weight(weight, (128, 128))]
    timed: list[GemmLaunch] = []
    real_close = fp8_gemm_sweep._close

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        timed.append(GemmLaunch(1, 1))
        return real_close(got, want)

    monkeypatch.setattr(fp8_gemm_sweep, "_close", close)
    monkeypatch.setattr(fp8_gemm_sweep, "_time", lambda fn, items, calls, args: float(len(timed)))
    row, best = fp8_gemm_sweep._sweep_one("t", 64, 128, 8, [weight], fp8, False, "cpu",
                                          argparse.Namespace(no_tma=False))
    candidates = fp8_gemm_sweep.candidates(8)
    assert len(timed) == len(row["sweep_us"]) >= len(candidates) and "wrong" not in row and "failed" not in row
    assert best == fp8_gemm_config.choose_launch(8, 64, 128, (128, 128), "cpu")
    assert row["best_us"] == min(row["sweep_us"].values()) and row["current_us"] == row["best_us"]


@pytest.mark.parametrize("cublas", [True, False])
def test_table_entry_turns_the_cublas_path_off(cublas: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the probe passed, ``torch._scaled_mm`` runs unless the launch says the Triton GEMM measured
    faster at these rows (the library's call stubbed: no GPU here)."""
    from vllm_actors.kernels import fp8_scaled_mm

    calls: list[int] = []

    def stub(x_q: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x_q.shape[0])
        return torch.zeros(x_q.shape[0], 256)

    monkeypatch.setattr(fp8_scaled_mm, "takes", lambda *args: True)
    monkeypatch.setattr(fp8_scaled_mm, "layout", lambda *args: fp8_scaled_mm.ScaleLayout(True, True, False))
    monkeypatch.setattr(fp8_scaled_mm, "scaled_mm", stub)
    weight, scale = fp8_gemm.quantize_weight(torch.randn(256, 512, generator=torch.Generator().manual_seed(0)),
                                             (128, 128))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    launch = GemmLaunch(16, 64, 128, 1, 4, 1, cublas=cublas)
    out = fp8_gemm.fp8_linear(x, weight, scale, (128, 128), config=fp8_gemm.Fp8GemmConfig(launch=launch))
    assert calls == ([5] if cublas else []) and bool(out.abs().sum()) != cublas
