"""Qwen3-8B's projections: bf16 cuBLAS and GEMV against the weight-only FP8 GEMV, the Triton W8A8
FP8 GEMM (block-wise scales) and vLLM's where it imports, at several row counts, in us and GB/s
(needs a CUDA GPU); ``--help`` lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.fp8_gemm_bench import main

raise SystemExit(main())
