"""The decode kernel's query groups (``decode_groups``: a verification step's consecutive rows of one
sequence, each KV tile read once for several of them) against a float64 reference: 1 to 8 rows a
sequence mixed in one batch, head groups that pack 16, 8, 5, 2 and 1 queries a program, block sizes
16 and 128, contexts crossing tile and split boundaries, the longest-first order, a sliding window and
soft cap, and an fp8 cache. Triton's interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.test_attention_options import dense_reference  # noqa: E402
from tests.support.fp8_case import make_fp8_case  # noqa: E402
from tests.support.paged_attention_case import (  # noqa: E402
    DEVICE,
    _exact_fp32_matmuls,  # noqa: F401 (autouse: float32 references without TF32)
    assert_close,
    make_case,
    poisoned_like,
    ta,
    write_new_tokens,
)
from tests.support.paged_batch import paged_batch  # noqa: E402
from vllm_actors.kernels.attention import AttentionMetadata  # noqa: E402
from vllm_actors.kernels.triton_decode import queries_per_program  # noqa: E402

# (cached, new tokens): 1 to 8 new tokens a sequence, contexts ending around tiles of 128 keys
MIXED = [(40, 3), (0, 1), (125, 8), (17, 1), (250, 5), (63, 2)]


def as_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step as one decode row per token (query starts, lengths, block tables) and its query groups."""
    lens, tables, first, end = [], [], [], []
    row = 0
    for seq, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        lens.extend(range(seq_len - q_len + 1, seq_len + 1))
        tables.extend([meta.block_tables[seq]] * q_len)
        first.extend([row] * q_len)
        end.extend([row + q_len] * q_len)
        row += q_len
    device = meta.seq_lens.device
    starts = torch.arange(row + 1, dtype=torch.int32, device=device)
    return (starts, torch.tensor(lens, dtype=torch.int32, device=device), torch.stack(tables),
            torch.tensor([first, end], dtype=torch.int32, device=device))


def run_grouped(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, num_splits: int | None, ordered: bool = False, **options: object) -> torch.Tensor:
    starts, lens, tables, groups = as_rows(meta)
    out = poisoned_like(q)
    order = torch.argsort(lens, descending=True) if ordered else None
    ta.paged_attention_decode(q, k_cache, v_cache, starts, lens, tables, max(meta.seq_lens_cpu), scale, out=out,
                              num_splits=num_splits, order=order, decode_groups=groups, **options)  # type: ignore[arg-type]  # the options' own types
    return out


def test_queries_a_program_takes() -> None:
    assert [queries_per_program(h, kv) for h, kv in ((4, 4), (4, 2), (9, 3), (8, 1), (32, 2), (64, 2))] \
        == [16, 8, 5, 2, 1, 1]


@pytest.mark.parametrize(
    "heads,block_size,num_splits,ordered",
    [((4, 2), 16, 1, False), ((9, 3), 16, 2, True), ((8, 1), 128, 8, False), ((4, 4), 128, None, True),
     ((16, 1), 16, 2, False)],
)
def test_grouped_rows_are_causal_attention(heads: tuple[int, int], block_size: int, num_splits: int | None,
                                           ordered: bool) -> None:
    """Each row sees its context and the rows before it, also where a group spans two programs
    (9 heads over 3: 5 queries a program; 8 over 1: 2; 16 over 1: 1) and where a split's range starts
    past a group's first rows (126 to 133 keys in 2 splits of a 128-key tile each; 8 splits, most empty)."""
    case = make_case(MIXED, block_size, heads[0], heads[1], 32, torch.float32, seed=heads[0] + block_size)
    write_new_tokens(case)
    out = run_grouped(case.q, case.k_cache, case.v_cache, case.meta, case.scale, num_splits, ordered)
    assert_close(out, case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_rows_in_half_precision(dtype: torch.dtype) -> None:
    case = make_case([(130, 6), (5, 1), (200, 4)], 16, 6, 2, 64, dtype, seed=9)
    write_new_tokens(case)
    assert_close(run_grouped(case.q, case.k_cache, case.v_cache, case.meta, case.scale, 2), case, dtype)


def test_plain_rows_as_groups_of_one_are_plain_decode() -> None:
    case = make_case([(40, 1), (0, 1), (300, 1)], 16, 4, 2, 32, torch.float32, seed=4)
    write_new_tokens(case)
    assert_close(run_grouped(case.q, case.k_cache, case.v_cache, case.meta, case.scale, 4), case, torch.float32)


@pytest.mark.parametrize(("window", "cap"), [(5, None), (140, 3.0)])
def test_grouped_rows_with_a_window_and_soft_cap(window: int, cap: float | None) -> None:
    batch = paged_batch([(20, 4), (150, 7), (3, 1)], 16, 6, 2, 16, torch.float32, device=DEVICE, seed=3)
    expected = dense_reference(batch, window, cap)  # writes the new tokens
    out = run_grouped(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, 2,
                      sliding_window=window, logits_soft_cap=cap)
    rel = ((out.double().cpu() - expected).norm() / expected.norm()).item()
    assert rel < 1e-4


@pytest.mark.parametrize("fp8_tiles", ["query", "float16"])
def test_grouped_rows_read_fp8(fp8_tiles: str) -> None:
    e4m3 = torch.float8_e4m3fn
    case = make_fp8_case([(40, 5), (255, 3), (0, 1)], 16, (6, 2), 32, torch.bfloat16, e4m3, seed=6,
                         kv_scales=(0.05, 0.3), device=DEVICE)
    out = run_grouped(case.q, case.k_cache, case.v_cache, case.meta, case.scale, 3, k_scale=case.k_scale,
                      v_scale=case.v_scale, fp8_tiles=fp8_tiles)
    assert_close(out, case, torch.bfloat16)  # type: ignore[arg-type]  # an Fp8Case has the fields it reads


def test_bad_groups_are_refused() -> None:
    case = make_case([(4, 2)], 16, 4, 2, 32, torch.float32, seed=1)
    starts, lens, tables, groups = as_rows(case.meta)
    with pytest.raises(ValueError, match="decode_groups must be int32"):
        ta.paged_attention_decode(case.q, case.k_cache, case.v_cache, starts, lens, tables, 6, case.scale,
                                  decode_groups=groups.long())
    with pytest.raises(ValueError, match=r"decode_groups must be int32 \[2, 2\]"):
        ta.paged_attention_decode(case.q, case.k_cache, case.v_cache, starts, lens, tables, 6, case.scale,
                                  decode_groups=groups[:, :1])


def test_the_device_check_passes_and_names_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    """``grouped_decode_agrees``, run before a speculating engine captures the grouped kernel: None where the
    grouped rows equal the rows attended alone; the reason where the kernel raises (as a compile error on a
    new device would) or disagrees."""
    from vllm_actors.kernels import decode_groups_check as check

    device = torch.device(DEVICE)
    assert check.grouped_decode_agrees(device, torch.float32, 2, 1, 16, 16) is None
    real = check.paged_attention_decode

    def raising(*args: object, decode_groups: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        if decode_groups is not None:
            raise RuntimeError("CompilationError: at 58:56")
        return real(*args, **kwargs)  # type: ignore[arg-type]  # the real call's own arguments

    monkeypatch.setattr(check, "paged_attention_decode", raising)
    assert "CompilationError" in (check.grouped_decode_agrees(device, torch.float32, 2, 1, 16, 16) or "")

    def wrong(*args: object, decode_groups: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)  # type: ignore[arg-type]  # the real call's own arguments
        return out * 2 if decode_groups is not None else out

    monkeypatch.setattr(check, "paged_attention_decode", wrong)
    assert "differ" in (check.grouped_decode_agrees(device, torch.float32, 2, 1, 16, 16) or "")
