"""``python -m vllm_actors.envs [--markdown]`` (``envs/table.py``)."""

import sys

from vllm_actors.envs.table import main

sys.exit(main())
