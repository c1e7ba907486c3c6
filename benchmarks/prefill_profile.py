"""Where a long prefill's time goes, by chunk and by kernel group (needs a CUDA GPU); ``--help`` lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.prefill_profile import main

main()
