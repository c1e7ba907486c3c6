"""``python -m vllm_actors.protocol [DIR]`` writes the messages' JSON Schema to DIR (default protocols/)."""

import sys
from pathlib import Path

from vllm_actors.protocol.codec import json_schema_text

target = Path(sys.argv[1] if len(sys.argv) > 1 else "protocols") / "messages.schema.json"
target.write_text(json_schema_text())
sys.stderr.write(f"wrote {target}\n")
