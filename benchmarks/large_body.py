"""One large request while /health is polled: answer time, /health's longest wait, serve's RSS; ``--help``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.large_body import main

raise SystemExit(main())
