"""The batch-1 projections of a model shape: cuBLAS against the Triton GEMV over a grid of launch
parameters (needs a CUDA GPU); ``--help`` lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.gemv_sweep import main

raise SystemExit(main())
