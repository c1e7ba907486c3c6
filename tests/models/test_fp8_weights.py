"""FP8 checkpoints (block-wise as Qwen3-FP8 ships them, compressed-tensors per channel and per
tensor), quantized here from the tiny Qwen3: dequantized at load on the CPU, the logits and greedy
tokens those of transformers on the dequantized weights; the Triton FP8 GEMMs in the model (the
interpreter) against a torch emulation of the same arithmetic; a TP=2 rank's weights and scales
the checkpoint's slices; and the quantization_config readings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import torch.nn.functional as F

from tests.support.fp8_checkpoints import UNQUANTIZED, quantize_checkpoint
from tests.support.tiny_models import PagedRunner
from vllm_actors.kernels import fp8_gemm
from vllm_actors.kernels.fp8_gemv import fp8_gemv_reference
from vllm_actors.models import fp8
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.loader import load_model
from vllm_actors.models.parallel import ShardLayout, TensorParallel
from vllm_actors.models.quant_config import fp8_scheme

CPU = torch.device("cpu")
PROMPT = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module", params=["block", "channel", "tensor"])
def checkpoints(request: pytest.FixtureRequest, tiny_qwen3: Path,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    strategy = request.param
    path, reference = quantize_checkpoint(tiny_qwen3, tmp_path_factory.mktemp("fp8") / strategy, strategy)
    return strategy, path, reference


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Prefill in two chunks, then one token a step."""
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    out = [runner.step({0: ids[:20]})[0], runner.step({0: ids[20:32]})[0]]
    out += [runner.step({0: [token]})[0] for token in ids[32:]]
    return torch.cat(out)


def _greedy(model: Any, ids: list[int], steps: int) -> list[int]:
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    logits, out = runner.step({0: ids})[0], []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = runner.step({0: [out[-1]]})[0]
    return out


def test_dequantized_at_load_matches_transformers(checkpoints: tuple[str, Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    strategy, path, reference = checkpoints
    ours, config = load_model(str(path), torch.float32, CPU)
    assert config.quantization is not None and config.quantization.strategy == strategy
    assert not any(isinstance(module, fp8.Fp8Linear) for module in ours.modules())  # the CPU: dequantized
    theirs = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor([PROMPT])).logits[0]
        generated = theirs.generate(torch.tensor([PROMPT[:12]]), max_new_tokens=16, do_sample=False)[0, 12:]
    got = _logits(ours, PROMPT)
    assert (got - expected).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert _greedy(ours, PROMPT[:12], 16) == generated.tolist()


def test_model_config_round_trip(checkpoints: tuple[str, Path, Path]) -> None:
    """The scheme travels with the config between the engine's processes (msgpack of ``to_dict``)."""
    config = ModelConfig.from_path(str(checkpoints[1]))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(config.to_dict()))
    assert ModelConfig.from_dict(wire) == config and config.quantization is not None


def _emulated_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the Triton GEMMs compute, in torch: activations quantized per token (and group), float64 products."""
    x_q, x_s = fp8_gemm.quantize_activations_torch(x, fp8_gemm.weight_groups(weight.shape, block)[1])
    return fp8_gemm.fp8_linear_reference(x_q, x_s, weight, scale, block, bias).to(x.dtype)


@pytest.mark.parametrize("strategy", ["block", "channel"])
def test_triton_fp8_gemms_in_the_model(strategy: str, tiny_qwen3: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every FP8 projection's output (a 16-token prefill: the GEMM; decode: the GEMV) is the torch
    emulation's of its input, and near its input times the dequantized weight (so its scales are
    the right ones); the logits near transformers' on the dequantized weights."""
    pytest.importorskip("triton")
    from transformers import AutoModelForCausalLM

    path, reference = quantize_checkpoint(tiny_qwen3, tmp_path / strategy, strategy)
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM", "triton")  # kept in FP8, also on CPU tensors (the interpreter)
    ours, _ = load_model(str(path), torch.float32, CPU)
    projections = [module for module in ours.modules() if isinstance(module, fp8.Fp8Linear)]
    assert len(projections) == 12 - (strategy == "block")  # 4 a layer; the block checkpoint leaves one out
    assert isinstance(ours.get_submodule(UNQUANTIZED), fp8.Fp8Linear) == (strategy != "block")
    rows: list[int] = []

    def check(module: fp8.Fp8Linear, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        x = inputs[0]
        if x.shape[0] <= fp8_gemm.gemv_rows():  # the weight-only GEMV: activations not quantized
            expected = fp8_gemv_reference(x, module.weight, module.scales, module.block, module.bias).to(x.dtype)
        else:
            expected = _emulated_fp8_linear(x, module.weight, module.scales, module.block, module.bias)
        torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
        exact = F.linear(x, fp8_gemm.dequantize_weight(module.weight, module.scales, module.block))
        assert (output - exact).abs().max().item() < 0.05 * exact.abs().max().item()
        rows.append(x.shape[0])

    for module in projections:
        module.register_forward_hook(check)  # type: ignore[arg-type]  # typed for Module
    runner = PagedRunner(ours, block_size=4, num_blocks=64)
    got = torch.cat([runner.step({0: PROMPT[:16]})[0]] + [runner.step({0: [t]})[0] for t in PROMPT[16:18]])
    assert sorted(set(rows)) == [1, 16]
    theirs = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(torch.tensor([PROMPT[:18]])).logits[0]
    assert F.cosine_similarity(got, expected, dim=-1).min().item() > 0.97  # per-token activation error


def test_tensor_parallel_shards(tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2 holds rows 32..63 of q_proj (blocks 2..3 of its scales) and columns 32..63 of
    o_proj (scale blocks 2..3), FP8 or dequantized; its weights are those of the whole model."""
    path, _ = quantize_checkpoint(tiny_qwen3, tmp_path / "block", "block")
    for choice in ("triton", "torch"):
        monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM", choice)
        whole, _ = load_model(str(path), torch.float32, CPU)
        rank, _ = load_model(str(path), torch.float32, CPU, tp=TensorParallel(rank=1, size=2))
        full, part = whole.hf_named_weights(), rank.hf_named_weights()
        attn = "model.layers.1.self_attn"
        assert torch.equal(part[f"{attn}.q_proj.weight"].float(), full[f"{attn}.q_proj.weight"][32:64].float())
        assert torch.equal(part[f"{attn}.o_proj.weight"].float(), full[f"{attn}.o_proj.weight"][:, 32:64].float())
        if choice == "triton":
            assert torch.equal(part[f"{attn}.q_proj.weight_scale_inv"], full[f"{attn}.q_proj.weight_scale_inv"][2:4])
            assert torch.equal(part[f"{attn}.o_proj.weight_scale_inv"],
                               full[f"{attn}.o_proj.weight_scale_inv"][:, 2:4])
            assert torch.equal(part[f"{attn}.v_proj.weight_scale_inv"], full[f"{attn}.v_proj.weight_scale_inv"][1:2])
    config = ModelConfig.from_path(str(path))
    layout = ShardLayout(config.__class__(**{**config.__dict__, "quantization": fp8_scheme(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})}), 1, 2)
    with pytest.raises(ValueError, match="not whole blocks of 128"):
        layout.slice_of("model.layers.0.self_attn.q_proj.weight_scale_inv")


CT: dict[str, Any] = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


@pytest.mark.parametrize(("quant", "match"), [
    ({"quant_method": "awq"}, "unsupported quantization_config.quant_method 'awq'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**CT, "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({**CT, "config_groups": {"g": {**CT["config_groups"]["g"], "input_activations": {
        "num_bits": 8, "type": "float", "dynamic": False}}}}, "static input scales"),
    ({**CT, "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "8-bit float"),
])  # fmt: skip
def test_quantization_config_errors(quant: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fp8_scheme({"quantization_config": quant})


def test_quantization_config_readings() -> None:
    block = fp8_scheme({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                "weight_block_size": [128, 128],
                                                "modules_to_not_convert": ["lm_head"]}})
    assert block is not None and (block.strategy, block.scale_name, block.block_size) == ("block", "weight_scale_inv",
                                                                                          (128, 128))
    assert block.ignores("lm_head") and not block.ignores("model.layers.0.mlp.down_proj")
    channel = fp8_scheme({"quantization_config": {**CT, "ignore": ["re:.*\\.mlp\\.down_proj$"]}})
    assert channel is not None and (channel.strategy, channel.scale_name) == ("channel", "weight_scale")
    assert channel.ignores("model.layers.3.mlp.down_proj") and not channel.ignores("model.layers.3.mlp.up_proj")
    groups = {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                          "dynamic": True}}}
    ct_block = fp8_scheme({"quantization_config": {**CT, "config_groups": groups}})
    assert ct_block is not None and (ct_block.block_size, ct_block.scale_name) == ((128, 128), "weight_scale")
    assert fp8_scheme({}) is None


def test_dummy_weights_are_quantized(checkpoints: tuple[str, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """load_format="dummy" (benchmarks' random weights) draws an FP8 projection as normal(0, 0.02) quantized."""
    strategy, path, _ = checkpoints
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM", "triton")
    model, _ = load_model(str(path), torch.float32, CPU, load_format="dummy")
    projection = model.get_submodule("model.layers.1.mlp.gate_up_proj")
    assert isinstance(projection, fp8.Fp8Linear) and projection.weight.dtype == torch.float8_e4m3fn
    weight = fp8_gemm.dequantize_weight(projection.weight, projection.scales, projection.block)
    assert 0.015 < weight.std().item() < 0.025 and projection.scales.min().item() > 0
