"""Sweep of the Triton decode kernel's launch parameters over the decode batches of nano-vllm's workload
(needs a CUDA GPU); ``--help`` lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.decode_sweep import main

main()
