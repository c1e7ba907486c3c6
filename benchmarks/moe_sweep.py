"""The fused MoE kernel's tiles per batch size at a model's expert shapes: a bounded grid timed on one
CUDA GPU, the best per batch size written as the table `kernels/moe_config.py` reads; ``--help``
lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.moe_sweep import main

raise SystemExit(main())
