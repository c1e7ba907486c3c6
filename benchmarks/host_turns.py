"""The time to first token of the next turn of a long conversation whose prefix was pushed out of the
GPU's KV pool: ours with the host KV tier and without, vLLM with its CPU KV offloading and without;
``--help`` lists the options and benchmarks/lib/host_turns.py says how it measures."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.host_turns import main

raise SystemExit(main())
