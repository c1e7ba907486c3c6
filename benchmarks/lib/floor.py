"""The GPU's ceilings and the throughput floor of a workload.

Two ceilings are measured on the GPU (``measure_ceilings``): the copy bandwidth (a large
device-to-device copy; bytes read plus bytes written per second) and the bf16 matmul rate (square
matmuls; 2·n³ FLOPs each). Both are medians of several runs timed with CUDA events.

The floor (``workload_floor``) is the least time any engine could take on the workload with those
ceilings, under a simple model of continuous batching:

* prefill costs 2 · parameters FLOPs per prompt token, at the matmul rate, and yields each
  request's first output token;
* every decode step reads all the weights once plus the live KV cache of every running sequence
  (its prompt and the tokens generated so far), and costs 2 · parameters FLOPs per running
  sequence plus the attention's 4 · layers · heads · head_dim FLOPs per token of context; the step
  takes max(bytes / bandwidth, FLOPs / rate);
* up to ``max_num_seqs`` requests run at once; a finished one frees its slot for the next waiting
  request (with the default 256 requests and 256 slots, all of them start together).

On PP x TP GPUs (``pipeline_parallel_size`` stages of ``tensor_parallel_size`` ranks; the ceilings
are one GPU's) the KV cache, the FLOPs and the prefill split evenly over all of them, the weights
over the TP ranks only: a stage's GPUs read their 1/PP of the weights once for each micro-batch in
flight, and keeping every stage busy takes PP micro-batches per step (with fewer, stages wait on
one another), so a step's weight time is weights / TP / bandwidth at any PP.

This module imports torch only inside the measuring functions: the floor model runs anywhere.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

GIB = 1 << 30


# --------------------------------------------------------------------------- the model's shape
@dataclass(frozen=True)
class ModelShape:
    """The figures of a decoder-only (Llama / Qwen3) model that the floor needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    dtype_bytes: int = 2

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], dtype_bytes: int = 2) -> ModelShape:
        """From the contents of a Hugging Face ``config.json``."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=config.get("model_type") == "qwen3",
            dtype_bytes=dtype_bytes,
        )

    @property
    def layer_parameters(self) -> int:
        hidden, head_dim = self.hidden_size, self.head_dim
        attention = hidden * self.num_heads * head_dim * 2 + hidden * self.num_kv_heads * head_dim * 2
        mlp = 3 * hidden * self.intermediate_size
        norms = 2 * hidden + (2 * head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def num_parameters(self) -> int:
        """Every weight, the embedding once when it is tied to the output projection."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_parameters + self.hidden_size + embeddings

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads: all of them (the output projection reads the
        whole embedding matrix; an untied input embedding is only gathered, a few rows)."""
        read = self.num_parameters
        if not self.tie_word_embeddings:
            read -= self.vocab_size * self.hidden_size
        return read * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token over all layers (114,688 bytes for Qwen3-0.6B in bf16)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_flops_per_context_token(self) -> int:
        """FLOPs of one query token against one token of context: QKᵀ and PV over all layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


# --------------------------------------------------------------------------- the ceilings
@dataclass(frozen=True)
class GpuCeilings:
    bandwidth: float  # bytes per second, read + written, device-to-device copy
    matmul_rate: float  # FLOPs per second, bf16 matmul
    device: str = ""
    copy_bytes: int = 0  # size of the copied buffer
    matmul_size: int = 0  # n of the n x n x n matmuls
    bandwidth_samples: tuple[float, ...] = ()
    matmul_samples: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_copy_bandwidth(size_bytes: int = 2 * GIB, repeats: int = 10, warmup: int = 3) -> list[float]:
    """Bytes per second (read + written) of ``size_bytes`` device-to-device copies, one per repeat."""
    import torch

    source = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    source.fill_(1)
    target = torch.empty_like(source)
    for _ in range(warmup):
        target.copy_(source)
    samples: list[float] = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        samples.append(2 * size_bytes / (start.elapsed_time(end) / 1e3))
    del source, target
    torch.cuda.empty_cache()
    return samples


def measure_matmul_rate(size: int = 8192, repeats: int = 20, warmup: int = 5) -> list[float]:
    """FLOPs per second of bf16 ``size``³ matmuls, one sample per repeat."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=generator)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=generator)
    c = torch.empty_like(a)
    for _ in range(warmup):
        torch.mm(a, b, out=c)
    samples: list[float] = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        samples.append(2 * size**3 / (start.elapsed_time(end) / 1e3))
    del a, b, c
    torch.cuda.empty_cache()
    return samples


def measure_ceilings(copy_bytes: int = 2 * GIB, matmul_size: int = 8192) -> GpuCeilings:
    """Median copy bandwidth and bf16 matmul rate of the current CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measuring the GPU's ceilings needs a CUDA device")
    bandwidth = measure_copy_bandwidth(copy_bytes)
    matmul = measure_matmul_rate(matmul_size)
    ceilings = GpuCeilings(
        bandwidth=statistics.median(bandwidth),
        matmul_rate=statistics.median(matmul),
        device=torch.cuda.get_device_name(),
        copy_bytes=copy_bytes,
        matmul_size=matmul_size,
        bandwidth_samples=tuple(bandwidth),
        matmul_samples=tuple(matmul),
    )
    log.info("gpu ceilings", device=ceilings.device, bandwidth_tb_s=round(ceilings.bandwidth / 1e12, 3),
             matmul_tflop_s=round(ceilings.matmul_rate / 1e12, 1))
    return ceilings


# --------------------------------------------------------------------------- the floor
@dataclass(frozen=True)
class Floor:
    seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    memory_bound_steps: int  # decode steps where bytes / bandwidth exceeded FLOPs / rate
    output_tokens: int
    prompt_tokens: int
    bytes_read: float  # by the decode steps, on all GPUs
    flops: float  # prefill and decode
    bandwidth: float  # one GPU's
    matmul_rate: float  # one GPU's
    max_num_seqs: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def workload_floor(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    shape: ModelShape,
    bandwidth: float,
    matmul_rate: float,
    max_num_seqs: int = 256,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> Floor:
    """The least time (and so the highest output tok/s) for the workload under the model of this
    module's docstring. ``output_lens`` are the output tokens of each request (``max_tokens`` when
    EOS is ignored)."""
    if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be at least 1, got "
                         f"{tensor_parallel_size} and {pipeline_parallel_size}")
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompts but {len(output_lens)} output lengths")
    if bandwidth <= 0 or matmul_rate <= 0:
        raise ValueError("bandwidth and matmul_rate must be positive")
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be at least 1")
    gpus = tensor_parallel_size * pipeline_parallel_size  # the ceilings below are all of them together
    params = shape.num_parameters
    weight_bytes = shape.weight_bytes_per_step * pipeline_parallel_size  # read PP times a step (docstring)
    kv_bytes = shape.kv_bytes_per_token
    attention_flops = shape.attention_flops_per_context_token
    all_bandwidth, all_rate = bandwidth * gpus, matmul_rate * gpus

    prompt_tokens = sum(prompt_lens)
    prefill_flops = 2.0 * params * prompt_tokens
    prefill_seconds = prefill_flops / all_rate

    # Each running request: [decode steps left, context it reads at its next decode step].
    # Prefill gives the first token, so a request of n output tokens needs n - 1 decode steps,
    # the first of which reads its prompt and that first token.
    waiting = deque(
        (output - 1, prompt + 1) for prompt, output in zip(prompt_lens, output_lens, strict=True) if output > 0
    )
    running: list[list[int]] = []
    decode_seconds = bytes_read = decode_flops = 0.0
    steps = memory_bound = 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            left, context = waiting.popleft()
            if left > 0:
                running.append([left, context])
        if not running:
            continue
        context_tokens = sum(entry[1] for entry in running)
        step_bytes = weight_bytes + context_tokens * kv_bytes
        step_flops = 2.0 * params * len(running) + attention_flops * context_tokens
        memory_time, compute_time = step_bytes / all_bandwidth, step_flops / all_rate
        decode_seconds += max(memory_time, compute_time)
        memory_bound += int(memory_time >= compute_time)
        bytes_read += step_bytes
        decode_flops += step_flops
        steps += 1
        for entry in running:
            entry[0] -= 1
            entry[1] += 1
        running = [entry for entry in running if entry[0] > 0]

    return Floor(
        seconds=prefill_seconds + decode_seconds,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        decode_steps=steps,
        memory_bound_steps=memory_bound,
        output_tokens=sum(output_lens),
        prompt_tokens=prompt_tokens,
        bytes_read=bytes_read,
        flops=prefill_flops + decode_flops,
        bandwidth=bandwidth,
        matmul_rate=matmul_rate,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )
