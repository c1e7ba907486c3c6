"""On a GPU: the decode kernel's query groups (a verification step's rows of one sequence attended by
one program per KV head and split) against float64, at model shapes (SmolLM2's 9 heads over 3 at
head_dim 64, Llama-3-8B's 32 over 8 at 128), block sizes 16 and 128, contexts of thousands of keys
split many ways, bf16 and an fp8 cache; and in a CUDA graph replayed with other groups, lengths and
tables than it was captured with. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_decode_query_groups import as_rows, run_grouped
from tests.support.fp8_case import make_fp8_case
from tests.support.paged_attention_case import (
    DEVICE,
    HAS_CUDA,
    Case,
    assert_close,
    captured,
    make_case,
    ta,
    write_new_tokens,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

# (cached, new tokens): 1 to 8 rows a sequence, long and short contexts mixed
SPECS = [(4093, 5), (130, 3), (2047, 8), (0, 1), (777, 7), (9000, 4), (15, 2), (1200, 1)]


@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((32, 8), 128)])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 16])
def test_gpu_grouped_rows_against_float64(heads: tuple[int, int], head_dim: int, block_size: int,
                                          num_splits: int | None) -> None:
    case = make_case(SPECS, block_size, heads[0], heads[1], head_dim, torch.bfloat16, seed=head_dim + block_size)
    write_new_tokens(case)
    out = run_grouped(case.q, case.k_cache, case.v_cache, case.meta, case.scale, num_splits, ordered=True)
    assert_close(out, case, torch.bfloat16)


@pytest.mark.parametrize("fp8_tiles", ["query", "float16"])
def test_gpu_grouped_rows_read_fp8(fp8_tiles: str) -> None:
    case = make_fp8_case(SPECS, 16, (9, 3), 64, torch.bfloat16, torch.float8_e4m3fn, seed=5, kv_scales=(0.05, 0.3),
                         device=DEVICE)
    out = run_grouped(case.q, case.k_cache, case.v_cache, case.meta, case.scale, None, k_scale=case.k_scale,
                      v_scale=case.v_scale, fp8_tiles=fp8_tiles)
    assert_close(out, case, torch.bfloat16)  # type: ignore[arg-type]  # an Fp8Case has the fields it reads


def test_gpu_grouped_rows_in_a_cuda_graph() -> None:
    """Captured over static inputs (as the decode graphs are), replayed for two steps of 24 rows each:
    other groupings, lengths and tables, the split count fixed by the capture's length bound."""
    steps = [[(3000, 8), (40, 1), (900, 5), (7, 3), (2000, 4), (0, 1), (64, 2)],
             [(10, 1)] * 6 + [(4000, 8), (129, 5), (2500, 3), (300, 2)]]
    cases = [make_case(specs, 16, 9, 3, 64, torch.bfloat16, seed=i, num_blocks=600) for i, specs in enumerate(steps)]
    width = max(case.meta.block_tables.shape[1] for case in cases)
    starts, lens, _, groups = (torch.zeros_like(x) for x in as_rows(cases[0].meta))
    tables = torch.zeros((lens.shape[0], width), dtype=torch.int32, device=DEVICE)
    q, out = torch.zeros_like(cases[0].q), torch.zeros_like(cases[0].q)
    k_cache, v_cache = torch.zeros_like(cases[0].k_cache), torch.zeros_like(cases[0].v_cache)

    def attend() -> None:
        ta.paged_attention_decode(q, k_cache, v_cache, starts, lens, tables, 4096, cases[0].scale, out=out,
                                  order=torch.argsort(lens, descending=True), decode_groups=groups)

    def load(case: Case) -> None:
        write_new_tokens(case)
        row_starts, row_lens, row_tables, row_groups = as_rows(case.meta)
        starts.copy_(row_starts)
        lens.copy_(row_lens)
        groups.copy_(row_groups)
        tables.zero_()
        tables[:, : row_tables.shape[1]].copy_(row_tables)
        q.copy_(case.q)
        k_cache.copy_(case.k_cache)
        v_cache.copy_(case.v_cache)

    load(cases[0])
    graph, _ = captured(attend)
    for case in cases:
        load(case)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, case, torch.bfloat16)
