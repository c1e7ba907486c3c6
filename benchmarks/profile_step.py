"""Where one engine step's time goes (GPU); ``--help`` lists the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.profile_step import main

raise SystemExit(main())
