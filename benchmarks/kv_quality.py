"""An fp8 KV cache's effect on a model's output over a long text (teacher forcing and greedy); ``--help``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.kv_quality import main

raise SystemExit(main())
