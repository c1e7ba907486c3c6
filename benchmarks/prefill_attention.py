"""Prefill attention at long context: the Triton varlen kernel against flash-attn 4 on the same paged
cache (needs a CUDA GPU; flash-attn's cases need it installed on a Hopper GPU). See
benchmarks/lib/prefill_attention.py for the cases.

    python benchmarks/prefill_attention.py --out results/prefill
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.prefill_attention import main

main()
