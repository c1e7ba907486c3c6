"""The supervised side of liveness: a child process pings after READY with the time its message in
hand has taken, the shell measures that time, the monitor reads the pings as whole lines; and only
the supervisor may ask the scheduler for a pipeline reset. Every wait has a generous safety deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import zmq

from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.runtime.monitor import LineReader

# A safety net for a child's first lines and a shell's first message, never a wait that must be long enough.
DEADLINE = float(os.environ.get("SUPERVISION_TEST_DEADLINE", "240"))

PINGING_CHILD = """
import sys
from vllm_actors.runtime.process import report, set_busy_source
set_busy_source(lambda: 1.25)
report("ready", info={"x": 1})
sys.stdin.read()  # until the parent closes our stdin
"""


def test_a_child_pings_after_ready_with_its_busy_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", PINGING_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    killer = threading.Timer(DEADLINE, child.kill)  # a safety net: readline blocks until a line comes
    killer.start()
    try:
        assert child.stdout is not None
        lines = [json.loads(child.stdout.readline()) for _ in range(3)]
        assert lines == [{"status": "ready", "info": {"x": 1}}, *[{"status": "alive", "busy": 1.25}] * 2]
    finally:
        killer.cancel()
        child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


def test_the_shell_reports_how_long_the_message_in_hand_takes(tmp_path: Path) -> None:
    from vllm_actors.protocol.codec import MessageCodec
    from vllm_actors.protocol.messages import AbortRequests
    from vllm_actors.runtime.zmq_shell import ActorShell

    seen: list[tuple[bool, float]] = []
    handled = threading.Event()

    class Slow:
        name = "slow"

        def handle(self, message: object) -> Outputs:
            seen.append((shell.busy_since is not None, shell.busy_seconds()))
            handled.set()
            return Outputs()

    context = zmq.Context()
    shell = ActorShell(context, Slow(), "slow", f"ipc://{tmp_path}/inbox", f"ipc://{tmp_path}/bus", {},
                       {AbortRequests: None})
    stop = threading.Event()
    serving = threading.Thread(target=shell.run, args=(stop,))
    serving.start()
    sender = context.socket(zmq.DEALER)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(f"ipc://{tmp_path}/inbox")
    try:
        assert shell.busy_seconds() == 0.0
        sender.send(MessageCodec().encode(AbortRequests(request_ids=[])))
        assert handled.wait(DEADLINE)
        assert seen[0][0] and seen[0][1] >= 0.0  # busy while handling
    finally:
        stop.set()
        serving.join()
        sender.close()
        shell.close()
        context.term()
    assert shell.busy_since is None and shell.busy_seconds() == 0.0


def test_the_line_reader_splits_whole_lines() -> None:
    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "rb") as stream:
        reader = LineReader(stream)
        os.write(write_end, b'{"a": 1}\n{"b"')
        reader.fill()
        assert reader.lines() == [b'{"a": 1}']
        os.write(write_end, b': 2}\n\n')
        reader.fill()
        assert reader.lines() == [b'{"b": 2}'] and not reader.eof
        os.close(write_end)
        reader.fill()
        assert reader.eof and reader.lines() == []


def test_only_the_supervisor_may_ask_the_scheduler_for_a_pipeline_reset(tiny_qwen3: Path) -> None:
    from vllm_actors.protocol.config import resolve_scheduler_config
    from vllm_actors.protocol.messages import RecoverPipeline
    from vllm_actors.runtime.process import ActorSpec
    from vllm_actors.runtime.roles import role_of
    from vllm_actors.runtime.run_dir import make_addresses

    config = EngineConfig(model=str(tiny_qwen3))
    spec = ActorSpec(role="scheduler", actor_id="scheduler", addresses=make_addresses(Path("/nonexistent"), 1),
                     engine=config, scheduler=resolve_scheduler_config(config, 256, 32), num_blocks=32)
    role = role_of(spec.role)
    role.build(spec)  # the role builds from this spec
    accepts = role.accepts(spec.replica)
    assert accepts[RecoverPipeline] == frozenset({b"supervisor"})

