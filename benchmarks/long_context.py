"""Time to first token and decode at long contexts (16k to 1M tokens), our engine against vLLM and
SGLang, one request at a time, against the measured-bandwidth floor; ``--help`` lists the options
and benchmarks/lib/long_context.py says how it measures."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.long_context import main

raise SystemExit(main())
