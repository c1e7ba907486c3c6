"""Which block-scaled FP8 recipes this torch runs on this GPU: every scale layout of
``kernels/fp8_scaled_mm.py`` tried on the probe's product, each error printed whole (the engine's probe
logs only each error's first line), then the library's timing against the Triton GEMM where one passes."""

from __future__ import annotations

import json
import traceback

import torch

from vllm_actors.kernels import fp8_scaled_mm
from vllm_actors.kernels.fp8_gemm import fp8_linear_reference, quantize_activations, quantize_weight


def main() -> int:
    device = torch.device("cuda", 0)
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                      "device": torch.cuda.get_device_name(device),
                      "functional_scaled_mm": hasattr(torch.nn.functional, "scaled_mm")}), flush=True)
    rows, k, n = fp8_scaled_mm.PROBE_SHAPE
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((rows, k), generator=gen, device=device).to(torch.bfloat16)
    weight, scale = quantize_weight(0.02 * torch.randn((n, k), generator=gen, device=device), fp8_scaled_mm.BLOCK)
    for candidate in fp8_scaled_mm.LAYOUTS:
        try:
            x_q, x_s = quantize_activations(fp8_scaled_mm.pad_rows(x, candidate), 128, candidate.a_column_major)
            scale_b = fp8_scaled_mm.weight_scales(scale, candidate)
            print(f"{candidate}: x_s {tuple(x_s.shape)} strides {x_s.stride()}, scale_b {tuple(scale_b.shape)} "
                  f"strides {scale_b.stride()}", flush=True)
            got = fp8_scaled_mm.scaled_mm(x_q, x_s, weight, scale, candidate, None, torch.bfloat16)[:rows].double()
            want = fp8_linear_reference(x_q[:rows], x_s[:rows].contiguous(), weight, scale, fp8_scaled_mm.BLOCK)
            print(f"  relative error {float((got - want).norm() / want.norm()):.4g}", flush=True)
        except Exception:  # noqa: BLE001 - every refusal is the finding
            print("  " + traceback.format_exc(limit=2).replace("\n", "\n  ")[:3000], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
