"""Build a CausalLM from a Hugging Face directory or a GGUF file."""

from __future__ import annotations

import time

import structlog
import torch

from vllm_actors.envs import envs
from vllm_actors.kernels.attention import get_attention_backend
from vllm_actors.kernels.fp8_gemm import FP8_DTYPE
from vllm_actors.models import fp8, registry
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.echo_weights import make_echo
from vllm_actors.models.llama import CausalLM
from vllm_actors.models.meta_init import materialize, meta_modules
from vllm_actors.models.parallel import TensorParallel
from vllm_actors.models.pipeline import PipelineStage

log = structlog.get_logger(__name__)

LOAD_FORMATS = ("auto", "dummy")


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights in the real shapes (vLLM's load_format="dummy"): normal(0, 0.02) matrices
    and embeddings, norms at 1. For benchmarks on machines without the checkpoint."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, fp8.Fp8Linear):
                module.init_dummy(generator)
        for name, parameter in model.named_parameters():
            if parameter.dtype == FP8_DTYPE or name.endswith(("weight_scale", "weight_scale_inv")):
                continue  # an Fp8Linear's, drawn above
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02, generator=generator)


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallel | None = None,
    stage: PipelineStage | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Load weights at path into a CausalLM of the given dtype on device, in eval mode.
    ``load_format="dummy"`` reads only the configuration and draws random weights. ``tp``: load
    this rank's shard only (safetensors: only its rows or columns are read; GGUF: only its rows, or
    of a row-parallel weight whole rows dequantized then cut to its columns: quantized blocks run
    along the rows; one tensor at a time); ``stage``: only that pipeline stage's layers."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    start = time.perf_counter()
    device = torch.device(device)
    config = ModelConfig.from_path(path)
    model_cls = registry.model_class(config.architecture)
    with meta_modules():  # the weights are loaded (or drawn) once materialized
        model = model_cls(config, attn_backend=get_attention_backend(device), tp=tp, stage=stage)
    model = model.to(dtype=dtype)
    if config.quantization is not None and fp8.keeps_fp8(device):  # FP8 projections (after the cast)
        fp8.use_fp8_linears(model, model.local_config, config.quantization, model.tp.size)
    model = materialize(model, device)
    model.tie_weights()  # materialize re-creates parameters: tie them again
    if load_format == "dummy":
        init_dummy_weights(model, seed)
        if envs.VLLM_ACTORS_DUMMY_WEIGHTS == "echo":  # benchmarks: greedy output robust to rounding
            make_echo(model)
    elif config.source == "gguf":
        from vllm_actors.models.gguf_loader import GGUFSource

        model.load_from(GGUFSource(config.path, config))
    else:
        from vllm_actors.models.hf_loader import SafetensorsSource

        with SafetensorsSource(config.path) as source:
            model.load_from(source)
    model.eval()
    log.info(
        "model_loaded",
        path=path,
        architecture=config.architecture,
        source=config.source,
        dtype=str(dtype),
        device=str(device),
        seconds=round(time.perf_counter() - start, 2),
    )
    return model, config
