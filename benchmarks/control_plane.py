"""The scheduler and KV-cache manager alone, replaying shared-prefix admissions (CPU); ``--help`` lists
the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.control_plane import main

raise SystemExit(main())
