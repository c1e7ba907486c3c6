"""An actor's wait for its next message ends when the process gets SIGTERM (runtime/signal_wake.py),
not at its poll's timeout: every stop of a group waited up to 100 ms for each of its phases."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROBE = """
import os, signal, sys, threading, time
import zmq
from vllm_actors.runtime.process import install_signal_handlers
from vllm_actors.runtime.zmq_shell import ZmqEndpoint

stop = threading.Event()
install_signal_handlers(stop)
context = zmq.Context()
endpoint = ZmqEndpoint(context, "probe", "ipc://" + sys.argv[1], {})
# The signal comes from another thread, as the supervisor's lands on any of the process's threads.
threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
message = endpoint.recv(timeout_ms=600_000)  # a wait far past this probe's own timeout
print(message, stop.is_set())
endpoint.router.close()
context.term()
"""


def test_sigterm_ends_an_actors_wait_for_a_message(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "inbox")], capture_output=True, text=True,
                          timeout=120)  # a safety net: without the wake-up the wait lasts 600 s
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "True"]
