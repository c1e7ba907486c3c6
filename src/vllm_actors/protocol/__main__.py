"""``python -m vllm_actors.protocol [DIR]`` writes the wire schemas to DIR (default protocols/)."""

import sys
from pathlib import Path

from vllm_actors.protocol.codec import json_schema_texts

folder = Path(sys.argv[1] if len(sys.argv) > 1 else "protocols")
for name, text in json_schema_texts().items():
    (folder / name).write_text(text)
    sys.stderr.write(f"wrote {folder / name}\n")
