"""Batch-1 decode attention at 128k-1M keys: the Triton decode kernel's splits and tiles against the
copy bandwidth (needs a CUDA GPU); ``--help`` lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.decode_long import main

main()
