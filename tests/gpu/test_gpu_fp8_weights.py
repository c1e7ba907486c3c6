"""On a GPU: the FP8 weight GEMMs at Qwen3-8B's projection shapes (block-wise [128, 128] and per
channel) in bfloat16 against float64 on the same quantized activations, eager and replayed from a
CUDA graph; and tiny FP8 checkpoints through the engine (FP8 projections): CUDA graphs give the
eager tokens.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.fp8_checkpoints import quantize_checkpoint
from vllm_actors import LLM, SamplingParams
from vllm_actors.kernels import fp8_gemm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Qwen3-8B's projections: qkv (4096 + 2 * 1024 rows), o, gate_up, down
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def _problem(rows: int, n: int, k: int, block: tuple[int, int] | None, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((rows, k), generator=gen, device="cuda").bfloat16()
    weight, scale = fp8_gemm.quantize_weight(0.02 * torch.randn((n, k), generator=gen, device="cuda"), block)
    return x, weight, scale


@pytest.mark.parametrize("scaled_mm", [True, False], ids=["scaled_mm", "triton"])
@pytest.mark.parametrize("block", [(128, 128), None], ids=["block128", "channel"])
@pytest.mark.parametrize("rows", [1, 7, 64, 1000])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_fp8_gemm_against_float64(shape: tuple[int, int], rows: int, block: tuple[int, int] | None, scaled_mm: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The W8A8 paths: torch._scaled_mm where its probe passed ([128, 128] blocks, rows > 1), else and
    with ``scaled_mm=False`` the Triton GEMM (and its one-row GEMV)."""
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMV_ROWS", "0")  # the W8A8 paths (the weight-only GEMV: below)
    x, weight, scale = _problem(rows, *shape, block, seed=rows)
    got = fp8_gemm.fp8_linear(x, weight, scale, block, config=fp8_gemm.Fp8GemmConfig(scaled_mm=scaled_mm))
    x_q, x_s = fp8_gemm.quantize_activations(x, fp8_gemm.weight_groups(weight.shape, block)[1])
    want = fp8_gemm.fp8_linear_reference(x_q, x_s, weight, scale, block)
    assert got.dtype == torch.bfloat16
    assert float((got.double() - want).norm() / want.norm()) < 1e-2  # bfloat16's rounding of the output
    exact = x.double() @ fp8_gemm.dequantize_weight(weight, scale, block).double().T
    assert float((got.double() - exact).norm() / exact.norm()) < 6e-2  # the activations' e4m3 rounding


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block128", "channel"])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_fp8_gemv_against_float64(shape: tuple[int, int], rows: int, block: tuple[int, int] | None) -> None:
    """The weight-only GEMV (activations not quantized) against float64 on the dequantized weight,
    through ``fp8_linear``; the down projection's shape also reading SiLU(gate) * up."""
    from vllm_actors.kernels.fp8_gemv import fp8_gemv, fp8_gemv_reference

    x, weight, scale = _problem(rows, *shape, block, seed=rows)
    got = fp8_gemm.fp8_linear(x, weight, scale, block)
    want = fp8_gemv_reference(x, weight, scale, block)
    assert got.dtype == torch.bfloat16
    assert float((got.double() - want).norm() / want.norm()) < 1e-2  # bfloat16's rounding of the output
    if rows == 1:
        gate_up = torch.randn((1, 2 * shape[1]), device="cuda").bfloat16()
        fused = fp8_gemv(gate_up, weight, scale, block, silu_mul=True)
        want = fp8_gemv_reference(gate_up, weight, scale, block, silu_mul=True)
        assert float((fused.double() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("launch", [(32, 512, 8, 4, 2), (16, 2048, 8, 2, 1), (8, 512, 4, 3, 2)],
                         ids=["32x512w8s4t2", "16x2048w8s2t1", "8x512w4s3t2"])
def test_fp8_gemv_table_launch_against_float64(launch: tuple[int, int, int, int, int], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """GEMV launches of `benchmarks/fp8_gemm.py --sweep-gemv`'s grid, taken from a tuned table keyed by
    this GPU's name (``VLLM_ACTORS_FP8_GEMM_CONFIG``), through ``fp8_linear`` at 1 and 2 rows, eager and
    replayed from a CUDA graph, against float64."""
    import json

    from vllm_actors.kernels import fp8_gemm_config
    from vllm_actors.kernels.fp8_gemv import Fp8GemvConfig, choose_config, fp8_gemv_reference

    block_n, block_k, warps, stages, tiles = launch
    config = Fp8GemvConfig(block_n=block_n, block_k=block_k, warps=warps, stages=stages, tiles=tiles)
    n, k = 4096, 12288
    table = fp8_gemm_config.table_json(n, k, (128, 128), torch.cuda.get_device_name(), {}, gemv={1: config, 2: config})
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps({"format": fp8_gemm_config.FORMAT, "tables": [table]}))
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM_CONFIG", str(path))
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMV_ROWS", "2")
    for rows in (1, 2):
        x, weight, scale = _problem(rows, n, k, (128, 128), seed=block_n + rows)
        assert choose_config(rows, weight, scale, (128, 128)) == config
        got = fp8_gemm.fp8_linear(x, weight, scale, (128, 128))
        want = fp8_gemv_reference(x, weight, scale, (128, 128))
        assert float((got.double() - want).norm() / want.norm()) < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fp8_gemm.fp8_linear(x, weight, scale, (128, 128))
        graph.replay()
        torch.testing.assert_close(captured, got, atol=0, rtol=0)


def test_scaled_mm_probe_passes_on_hopper() -> None:
    """On an H100/H200 torch's cuBLASLt block-scaled FP8 GEMM is expected to take one of the probed
    scale layouts (else the large-batch FP8 path is the slower Triton GEMM: the log says why)."""
    from vllm_actors.kernels import fp8_scaled_mm

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuBLASLt's 1x128 / 128x128 recipe is Hopper's")
    layout = fp8_scaled_mm.layout(torch.device("cuda"), lambda x, column: fp8_gemm.quantize_activations(x, 128, column))
    assert layout is not None, "torch._scaled_mm refused every scale layout or gave another result"


@pytest.mark.parametrize("launch", [(64, 128, 32, 4, 3, False), (128, 128, 32, 8, 4, False),
                                    (64, 256, 32, 8, 3, False), (256, 128, 32, 8, 3, False),
                                    (128, 64, 32, 4, 4, False), (128, 128, 32, 8, 4, True), (64, 256, 32, 8, 3, True)],
                         ids=["64x128w4", "128x128w8", "64x256w8", "256x128w8", "128x64w4", "tma128x128w8",
                              "tma64x256w8"])
def test_sweep_launches_against_float64(launch: tuple[int, int, int, int, int, bool]) -> None:
    """Launches of `benchmarks/fp8_gemm.py --sweep`'s kinds (one weight scale block per tile or two; one
    or two warpgroups; stages fit to shared memory; tiles by pointers or through tensor descriptors) at
    the o projection's shape and 300 rows."""
    from vllm_actors.kernels.fp8_gemm_config import GemmLaunch, fit_stages

    block_m, block_n, group_m, warps, stages, tma = launch
    config = fp8_gemm.Fp8GemmConfig(
        launch=fit_stages(GemmLaunch(block_m, block_n, 128, group_m, warps, stages, tma)), scaled_mm=False)
    x, weight, scale = _problem(300, 4096, 4096, (128, 128), seed=block_n)
    got = fp8_gemm.fp8_linear(x, weight, scale, (128, 128), config=config)
    x_q, x_s = fp8_gemm.quantize_activations(x, 128)
    want = fp8_gemm.fp8_linear_reference(x_q, x_s, weight, scale, (128, 128))
    assert float((got.double() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("rows", [1, 2, 16, 256])
def test_fp8_gemm_graph_replay(rows: int) -> None:
    x, weight, scale = _problem(rows, 6144, 4096, (128, 128), seed=rows)
    fp8_gemm.fp8_linear(x, weight, scale, (128, 128))  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_gemm.fp8_linear(x, weight, scale, (128, 128))
    x.copy_(_problem(rows, 6144, 4096, (128, 128), seed=rows + 100)[0])
    graph.replay()
    torch.testing.assert_close(captured, fp8_gemm.fp8_linear(x, weight, scale, (128, 128)), atol=0, rtol=0)


@pytest.mark.parametrize("strategy", ["block", "channel"])
def test_tiny_fp8_engine_graphs_match_eager(strategy: str, tiny_qwen3: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = quantize_checkpoint(tiny_qwen3, tmp_path / strategy, strategy, block_size=(32, 32))
    rng = random.Random(5)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (3, 40, 150)]
    tokens = {}
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM", "triton")
    for name, eager in (("graphs", False), ("eager", True)):
        with LLM(str(path), executor="inprocess", dtype="bfloat16", max_num_batched_tokens=64, seed=0,
                 enforce_eager=eager) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["graphs"] == tokens["eager"]


def test_qwen3_fp8_shape_with_dummy_weights(tmp_path: Path) -> None:
    """Qwen3-0.6B's shape with Qwen3-FP8's quantization_config, random weights (the benchmarks'
    load_format="dummy"): every attention and MLP projection FP8, greedy decode through CUDA graphs."""
    from vllm_actors.bench.throughput_workload import QWEN3_8B_FP8_CONFIG, write_model_dir

    config = {**QWEN3_8B_FP8_CONFIG, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4,
              "num_attention_heads": 16, "num_key_value_heads": 8}
    path = write_model_dir(tmp_path / "qwen3-fp8", config)
    with LLM(str(path), executor="inprocess", dtype="bfloat16", load_format="dummy", max_model_len=512,
             skip_tokenizer_init=True, seed=0) as llm:
        outputs = llm.generate([{"prompt_token_ids": list(range(10, 300))}, {"prompt_token_ids": [5, 6, 7]}],
                               SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
