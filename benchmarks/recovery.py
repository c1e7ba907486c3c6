"""Recovery from a killed worker under load; ``--help`` lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.recovery import main

raise SystemExit(main())
