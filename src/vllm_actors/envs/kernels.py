"""The kernels' settings: each op's "Triton or torch", and the switches and tables of the Triton paths
(group ``kernels``)."""

from __future__ import annotations

from vllm_actors.envs.parsers import choice, fused_quant_mode, integer, text
from vllm_actors.envs.setting import Setting, kernel_switch, switch


class KernelSettings:
    """The ``kernels`` group's settings (``Envs`` inherits them)."""

    VLLM_ACTORS_ATTENTION = kernel_switch("Paged attention", "kernels")
    VLLM_ACTORS_PREFILL_ATTENTION = Setting(
        "auto", choice("auto", "triton", "flash_attn"),
        "Prefill attention on Hopper: flash-attn 4 (`flash_attn.cute`) where installed and measured faster "
        "(`auto`), wherever it can run (`flash_attn`), or never (`triton`).",
        kind="auto, triton, flash_attn", group="kernels")
    VLLM_ACTORS_FLASH_ATTN_PACK_GQA = Setting(
        "auto", choice("auto", "on", "off"),
        "flash-attn 4 prefill over grouped KV heads: pack a KV head's query heads into one tile (`on`), one query "
        "head a tile (`off`), or flash-attn's own choice (`auto`: packed whenever heads are grouped).",
        kind="auto, on, off", group="kernels")
    VLLM_ACTORS_FLASH_ATTN_SPLIT_KEYS = switch(
        "flash-attn 4 prefill: a chunk too short to fill the GPU over a long context is split over its keys "
        "(ranges attended in one more call, merged by log-sum-exp), such steps run eagerly outside the padded "
        "graphs (0: one call, in the padded graphs' Triton kernel there). On: a 1M-token prompt in a stream of "
        "short requests reached its first token 1.33x sooner with lower inter-token gaps (performance.md).",
        "kernels", default=True)
    VLLM_ACTORS_FLASH_ATTN_REPLAY = switch(
        "flash-attn 4 prefill: after two calls of a kind (dtypes, head and cache shapes, options) through its "
        "interface, call its compiled kernel directly (~0.3 -> ~0.02 ms of host time a call; flash_attn_replay.py); "
        "0: every call through flash_attn_varlen_func.",
        "kernels", default=True)
    VLLM_ACTORS_FP8_PREFILL_STAGING = switch(
        "Over an fp8 KV cache, a long one-sequence prefill chunk goes to flash-attn 4 through a bf16 staging of "
        "its context (where flash-attn runs; 0: the Triton kernel).", "kernels")
    VLLM_ACTORS_DECODE_FP8_TILES = Setting(
        "float16", choice("query", "float16"),
        "How the decode kernel's fp8 KV tiles meet bf16/fp16 queries (`kernels/triton_decode.py`, FP8_TILES): "
        "converted to the query's dtype (`query`), or to fp16 with the query cast once (`float16`).",
        kind="query, float16", group="kernels")
    VLLM_ACTORS_FUSED_OPS = kernel_switch("Fused RMSNorm, rotary, SiLU and embedding", "kernels")
    VLLM_ACTORS_FUSED_MOE = kernel_switch("Fused mixture-of-experts MLP (grouped GEMM over the tokens of each expert)",
                                          "kernels")
    VLLM_ACTORS_MOE_CONFIG = Setting[str | None](
        None, text, "A JSON file of tuned fused-MoE tiles per batch size (`benchmarks/moe_sweep.py` writes one), "
        "looked up before the tables shipped in `kernels/moe_configs/` (unset: those, else the built-in choice).",
        kind="path", group="kernels")
    VLLM_ACTORS_LORA_KERNEL = kernel_switch("Batched LoRA shrink and expand (the tokens of each adapter together)",
                                            "kernels")
    VLLM_ACTORS_FP8_GEMM = kernel_switch(
        "FP8 checkpoints' projections kept in FP8 (Triton FP8 GEMMs; `torch`: dequantized at load)", "kernels")
    VLLM_ACTORS_FP8_GEMV_SILU = switch(
        "At one row the FP8 down projection's weight-only GEMV applies SiLU(gate) * up itself (off: a separate "
        "silu_and_mul first; fused, the Qwen3-8B down projection took 45.0 us against 18.8 us unfused on an H200).",
        "kernels", default=False)
    VLLM_ACTORS_FP8_GEMV_ROWS = Setting(
        1, integer(0), "FP8 projections of up to this many rows (at most 4) run the weight-only GEMV, activations "
        "not quantized (0: the W8A8 GEMM and GEMV at every size; at 2 rows cuBLASLt's FP8 GEMM took 101 us a "
        "Qwen3-8B layer against the GEMV's 127 on an H200, at 4 rows the W8A8 GEMM was faster on an H100).",
        kind="int", group="kernels")
    VLLM_ACTORS_FP8_SCALED_MM = switch(
        "FP8 projections of [128, 128] blocks above the GEMV's rows run cuBLASLt's block-scaled FP8 GEMM "
        "(torch._scaled_mm) where a probe at first use gives the float64 reference's result (0: the Triton GEMM).",
        "kernels")
    VLLM_ACTORS_FP8_FUSED_QUANT = Setting(
        "graphs", fused_quant_mode, "FP8 projections above the GEMV's rows take their input quantized by the "
        "RMSNorm or SiLU(gate) * up before them (one kernel and one pass over the activations fewer, results "
        "identical): `1` in forwards run eagerly (prefill), `graphs` also inside the captured decode CUDA graphs "
        "(Qwen3-8B FP8 on an H200: 10,877 tok/s against 10,631 with `0`), `0` never.", kind="0, 1, graphs",
        group="kernels")
    VLLM_ACTORS_FP8_GEMM_CONFIG = Setting[str | None](
        None, text, "A JSON file of tuned Triton FP8 GEMM launches per weight shape and rows, and of the weight-only "
        "FP8 GEMV's at 1 to 4 rows (`benchmarks/fp8_gemm.py --sweep` and `--sweep-gemv` with `--table-out` write "
        "one), looked up before the tables shipped in `kernels/fp8_gemm_configs/` (unset: those, else the built-in "
        "choice).", kind="path", group="kernels")
    VLLM_ACTORS_FUSED_KV_WRITE = switch(
        "The rotary kernel also stores k and v in the KV cache (0: a separate write).", "kernels")
    VLLM_ACTORS_GEMV = switch("The Triton GEMV for projections of 1 or 2 rows (0: cuBLAS).", "kernels")
    VLLM_ACTORS_GEMV_SILU = switch("At one row the down projection's GEMV applies SiLU(gate) * up itself.", "kernels")
    VLLM_ACTORS_PDL = switch("Programmatic dependent launch of our Triton kernels (Hopper and later).", "kernels")
    VLLM_ACTORS_PDL_EARLY_LOADS = switch(
        "Under PDL, loads of what no recent kernel wrote move before the wait.", "kernels")
