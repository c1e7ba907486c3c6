"""What the tool-call tests share: vLLM's tool-call id format and the user turn that asks for a tool."""

from __future__ import annotations

import re

TOOL_ID = re.compile(r"^chatcmpl-tool-[0-9a-f]{32}$")  # vLLM's "chatcmpl-tool-" and 32 hex digits
ASK = [{"role": "user", "content": "Weather in Paris?"}]
