"""How long an engine actor keeps polling its inbox without blocking after its last message.

A decode step at batch 1 crosses three processes (worker -> scheduler -> KV-cache manager ->
worker), each hop a blocking ``poll`` woken by ZeroMQ. On the GPU machines (gVisor) a blocked
process takes long enough to wake that those wake-ups, not Python, set the time per token: py-spy
found the scheduler and the KV-cache manager 82-86% idle in ``poll`` at 2.4-2.7 ms/token, and the
GPU 1.3 ms per step. So while messages keep coming, an actor polls without blocking (yielding the
core between looks) and blocks again after ``busy_poll_s`` without one: an idle engine burns no
CPU, a busy one answers each hop at once.

Default: on (``DEFAULT_BUSY_POLL_MS``) when the engine runs on a CUDA device, off on the CPU,
where the actors share the cores with the model and spinning would slow it. The
``VLLM_ACTORS_BUSY_POLL_MS`` environment variable overrides it (0 turns it off).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from vllm_actors.envs import Envs

BUSY_POLL_ENV = "VLLM_ACTORS_BUSY_POLL_MS"
DEFAULT_BUSY_POLL_MS = 20.0
NVIDIA_DRIVER = Path("/dev/nvidiactl")  # present wherever the NVIDIA driver is (checked without importing torch)


def busy_poll_seconds(device: str, environ: Mapping[str, str] | None = None,
                      has_nvidia_driver: bool | None = None) -> float:
    """Seconds of non-blocking polling after a message for an engine on ``device`` (``environ``
    None: this process's environment)."""
    settings = Envs(environ)
    milliseconds = settings.VLLM_ACTORS_BUSY_POLL_MS
    if milliseconds is not None:
        return max(milliseconds, 0.0) / 1000
    if device.startswith("cuda"):
        return DEFAULT_BUSY_POLL_MS / 1000
    if device == "auto":
        driver = NVIDIA_DRIVER.exists() if has_nvidia_driver is None else has_nvidia_driver
        hidden = settings.CUDA_VISIBLE_DEVICES in ("", "-1")
        return DEFAULT_BUSY_POLL_MS / 1000 if driver and not hidden else 0.0
    return 0.0
