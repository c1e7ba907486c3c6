"""The decode kernel's query groups checked on a device before a speculating engine captures them:
``grouped_decode_agrees`` runs one small grouped decode against the same rows attended one by one."""

from __future__ import annotations

import torch

from vllm_actors.kernels.triton_decode import paged_attention_decode


def grouped_decode_agrees(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int) -> str | None:
    """One small grouped decode (a sequence's 6 consecutive positions as one query group, split in two)
    on ``device`` against the same rows attended one by one: None where they agree, else why not (the
    kernel did not compile for this device, or it disagrees). Run once before a speculating engine's
    graphs capture the grouped kernel, so that a failure keeps verification off the query groups
    instead of failing the engine."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, context = 6, 3 * block_size + 5
    blocks = -(-context // block_size)
    k_cache, v_cache = (torch.randn((blocks, block_size, num_kv_heads, head_dim), generator=gen).to(device, dtype)
                        for _ in range(2))
    q = torch.randn((rows, num_heads, head_dim), generator=gen).to(device, dtype)
    starts = torch.arange(rows + 1, dtype=torch.int32, device=device)
    lens = torch.arange(context - rows + 1, context + 1, dtype=torch.int32, device=device)
    tables = torch.arange(blocks, dtype=torch.int32, device=device).repeat(rows, 1)
    groups = torch.tensor([[0] * rows, [rows] * rows], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    try:
        grouped = paged_attention_decode(q, k_cache, v_cache, starts, lens, tables, context, scale, num_splits=2,
                                         decode_groups=groups)
        alone = paged_attention_decode(q, k_cache, v_cache, starts, lens, tables, context, scale, num_splits=2)
        error = float((grouped.float() - alone.float()).abs().max())
    except Exception as caught:  # noqa: BLE001 - any failure of the new kernel is a reason to keep the old path
        return f"{type(caught).__name__}: {str(caught).splitlines()[0][:200] if str(caught) else ''}"
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    return None if error <= tolerance else f"grouped rows differ from single rows by {error:.3g}"
