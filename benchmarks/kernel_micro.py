"""Microbenchmark of the Triton kernels against torch (needs a CUDA GPU).

    python benchmarks/kernel_micro.py --out results/kernels.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.kernel_micro import main

main()
