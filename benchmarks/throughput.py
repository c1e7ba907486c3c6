"""nano-vllm's throughput benchmark on vllm_actors, against the GPU's floor and a peer (transformers or
vLLM); ``--help`` lists the options. ``vllm-actors bench throughput`` is the same without the comparisons."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.lib

from benchmarks.lib.throughput_compare import main

raise SystemExit(main())
