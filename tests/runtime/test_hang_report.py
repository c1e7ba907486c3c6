"""The GPU tests' hang report (``tests/support/hang_report.py``): an actor process's stacks come on
SIGUSR1 (``install_signal_handlers``), into its log, and the report gathers them without stopping it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.hang_report import ACTOR_MODULE, write_hang_report

CHILD = """
import sys, threading, time
from vllm_actors.runtime.process import install_signal_handlers
install_signal_handlers(threading.Event())
def waits_for_ever():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
waits_for_ever()
"""


def test_the_report_holds_each_actor_s_stacks_and_leaves_it_running(tmp_path: Path) -> None:
    log = tmp_path / "worker-0.log"
    with log.open("wb") as stderr:  # argv names the actor module, as an actor's command line does
        child = subprocess.Popen([sys.executable, "-c", CHILD, ACTOR_MODULE], stdout=subprocess.PIPE, stderr=stderr)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        report = tmp_path / "dumps" / "report.txt"
        write_hang_report(report, "tests/x.py::test_y", settle=120.0)  # returns once the dump is there
        text = report.read_text()
        assert f"=== process {child.pid}" in text
        assert "in waits_for_ever" in text and str(log) in text  # its stack, from its log's tail
        assert "in test_the_report_holds_each_actor_s_stacks_and_leaves_it_running" in text  # this process's own
        assert child.poll() is None, "SIGUSR1 must not end the actor"
    finally:
        child.kill()
        child.wait()
