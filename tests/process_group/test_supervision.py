"""Let it crash: the supervisor restarts any actor of a group, within a budget.

Real groups on the tiny model: a killed metrics store and bus come back, a stopped worker is found
hung and replaced, a worker killed mid-request resumes it from the host KV tier, and a group past its
restart budget fails, tells its listeners and leaves no process behind; the run directories of dead
supervisors are swept. Every wait is on an event or a condition, with a generous safety deadline.
The policy alone: runtime/test_restart_policy.py; the child's side: runtime/test_liveness_reports.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from tests.engine.test_engine_prefix_caching import drain, submit
from tests.support.server_helpers import BusRecorder, gone
from vllm_actors import SamplingParams
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.clients.sync_client import EngineClient
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import ActorFailed, ActorRestarted, event_type
from vllm_actors.protocol.metrics import EventsQuery, EventsReply, MetricsCodec, MetricsQuery, MetricsReply
from vllm_actors.runtime.supervisor import ActorDiedError, ProcessGroup

# A safety net for restarts (a worker reloads the model), never a wait that must be long enough.
DEADLINE = float(os.environ.get("SUPERVISION_TEST_DEADLINE", "240"))
LIVENESS_TIMEOUT = 2.0


def until(predicate: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.02)  # pacing between checks, not a wait for anything


def query(group: ProcessGroup, message: MetricsQuery, timeout: float = 10.0) -> MetricsReply | None:
    """One query to the metrics store on a fresh socket (None: no answer, e.g. while it restarts)."""
    codec = MetricsCodec()
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(group.addresses.metrics)
    try:
        socket.send(codec.encode(message))
        return codec.decode_reply(socket.recv()) if socket.poll(int(timeout * 1000)) else None
    finally:
        socket.close()


def supervisor_events(recorder: BusRecorder, kind: str, actor: str) -> list:
    return [e for e in recorder.events(kind) if getattr(e, "actor", None) == actor]


def answers(group: ProcessGroup, request_id: str) -> None:
    """A request through a fresh client finishes with all its tokens."""
    client = EngineClient(group.info)
    try:
        client.submit(client.prepare(request_id, {"prompt_token_ids": [5, 6, 7, 8]},
                                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
        finished = []
        deadline = time.monotonic() + DEADLINE
        while not finished:
            assert time.monotonic() < deadline, f"{request_id} did not finish"
            finished = [o for o in client.poll(100) if o.finished]
        assert finished[0].error is None and len(finished[0].outputs[0].token_ids) == 4
    finally:
        client.close()


def all_ready(group: ProcessGroup) -> bool:
    return set(group.state().values()) == {"ready"} and all(group.alive().values())


def group_config(model: Path, offload_gb: float = 0.004) -> EngineConfig:
    """The module's group: prefills in chunks of 128 tokens, a host KV tier (long prompts' blocks
    written through to it from 256 tokens: the fixture's environment)."""
    return EngineConfig(model=str(model), dtype="float32", block_size=16, num_gpu_blocks_override=80,
                        max_num_batched_tokens=128, kv_cache_offload_gb=offload_gb, seed=0)


@pytest.fixture(scope="module")
def group(tiny_qwen3: Path) -> Iterator[ProcessGroup]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ACTORS_KV_OFFLOAD_WRITE_THROUGH_TOKENS", "256")
        with ProcessGroup(group_config(tiny_qwen3), max_restarts=20, liveness_timeout=LIVENESS_TIMEOUT) as started:
            yield started


@pytest.fixture
def recorder(group: ProcessGroup) -> Iterator[BusRecorder]:
    until(lambda: all_ready(group), "every actor ready")
    recording = BusRecorder(group.addresses.bus_out, group.addresses.bus_in)
    yield recording
    recording.close()


def test_a_killed_metrics_store_comes_back_and_records_its_restart(group: ProcessGroup,
                                                                   recorder: BusRecorder) -> None:
    old = group.pids()["metrics"]
    noticed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    until(lambda: supervisor_events(recorder, "ACTOR_RESTARTED", "metrics"), "ACTOR_RESTARTED of the store")
    print(f"\nmetrics store: killed -> ACTOR_RESTARTED on the bus in {time.monotonic() - noticed:.2f} s")
    failed = supervisor_events(recorder, "ACTOR_FAILED", "metrics")[0]
    assert failed.how == "exited" and failed.detail == "killed by SIGKILL"
    new = group.pids()["metrics"]
    assert new != old and gone(old)
    assert group.state()["metrics"] == "ready" and group.restarts()["metrics"] >= 1

    # The new store has the supervisor's report of its own restart.
    until(lambda: store_has_restart(group, "metrics", new), "ACTOR_RESTARTED in the new store")
    answers(group, "after-metrics")
    group.raise_if_dead()  # recovered: nothing to raise


def store_has_restart(group: ProcessGroup, actor: str, pid: int) -> bool:
    """The metrics store recorded the supervisor's ACTOR_RESTARTED of ``actor`` as process ``pid``."""
    reply = query(group, EventsQuery(since_index=0, limit=100_000))
    return isinstance(reply, EventsReply) and any(
        entry.actor == "supervisor" and isinstance(entry.event, ActorRestarted) and entry.event.actor == actor
        and entry.event.pid == pid for entry in reply.events)


def test_a_killed_bus_comes_back_and_events_flow_again(group: ProcessGroup, recorder: BusRecorder) -> None:
    old = group.pids()["bus"]
    noticed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    until(lambda: group.restarts().get("bus") and group.state()["bus"] == "ready", "the bus restarted")
    new = group.pids()["bus"]
    assert new != old and gone(old)
    # The supervisor publishes once the store is seen to hear it again. (A subscriber of ours may
    # miss that: its subscription reaches the new bus when it does, perhaps later than the store's.)
    until(lambda: store_has_restart(group, "bus", new), "ACTOR_RESTARTED of the bus in the store")
    print(f"\nbus: killed -> ACTOR_RESTARTED in the store in {time.monotonic() - noticed:.2f} s")
    after = BusRecorder(group.addresses.bus_out, group.addresses.bus_in)  # joined once the bus is back
    try:
        answers(group, "after-bus")
        after.wait_for("FINISHED", "after-bus")  # the scheduler's events reach the new bus
    finally:
        after.close()


def test_a_stopped_worker_is_found_hung_killed_and_replaced(group: ProcessGroup, recorder: BusRecorder) -> None:
    old = group.pids()["worker-0"]
    stopped = time.monotonic()
    os.kill(old, signal.SIGSTOP)
    try:
        until(lambda: supervisor_events(recorder, "ACTOR_FAILED", "worker-0"), "ACTOR_FAILED of the worker")
    finally:
        if not gone(old):
            os.kill(old, signal.SIGCONT)
    detected = time.monotonic() - stopped
    failed: ActorFailed = supervisor_events(recorder, "ACTOR_FAILED", "worker-0")[0]
    print(f"\nworker SIGSTOP -> ACTOR_FAILED(hung) in {detected:.2f} s (liveness_timeout {LIVENESS_TIMEOUT} s): "
          f"{failed.detail}")
    assert failed.how == "hung" and "no liveness ping" in failed.detail
    assert detected < LIVENESS_TIMEOUT + 5.0  # a ping every 0.5 s, a poll every 0.1 s: a generous margin
    until(lambda: supervisor_events(recorder, "ACTOR_RESTARTED", "worker-0"), "ACTOR_RESTARTED of the worker")
    restarted: ActorRestarted = supervisor_events(recorder, "ACTOR_RESTARTED", "worker-0")[0]
    print(f"worker restarted in {restarted.seconds:.2f} s (pid {restarted.pid})")
    assert gone(old) and restarted.pid == group.pids()["worker-0"] != old
    # The scheduler got RecoverPipeline from the supervisor: it resets its pipeline (PIPELINE_RESET).
    # Until the scheduler handles RecoverPipeline, it crashes on it and is restarted in turn.
    def scheduler_told() -> bool:
        return bool([b for b in list(recorder.batches) if b.actor == "scheduler" and any(
            event_type(e) == "PIPELINE_RESET" or (event_type(e) == "CRASHED" and "RecoverPipeline" in e.error)
            for e in b.events)])

    until(scheduler_told, "the scheduler's reaction to RecoverPipeline")
    until(lambda: all_ready(group), "every actor ready")
    answers(group, "after-worker")


def test_a_worker_killed_mid_request_resumes_from_the_host_tier(group: ProcessGroup, recorder: BusRecorder,
                                                                tiny_qwen3: Path) -> None:
    """The host tier's memory is the supervisor's (a memfd per worker rank): the SIGKILLed worker's
    successor maps it again, and the re-queued request's prefix hits the blocks written through
    before the kill whose copies are known complete: restored, not recomputed. The greedy tokens
    are those of an uninterrupted run; the events count the tokens recomputed."""
    num_prompt, max_tokens = 960, 16  # 60 blocks of 16, 8 chunks of 128
    prompt = [random.Random(7).randrange(1, 500) for _ in range(num_prompt)]
    reference = InProcessEngine(group_config(tiny_qwen3, offload_gb=0.0), tokenizer=None)
    submit(reference, "uninterrupted", prompt, max_tokens=max_tokens, ignore_eos=True)
    expected = drain(reference)["uninterrupted"]
    client = EngineClient(group.info)
    try:
        client.submit(client.prepare("long", {"prompt_token_ids": prompt},
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
        until(lambda: len(recorder.events("STEP_FINISHED")) >= 5, "five chunks computed")
        old = group.pids()["worker-0"]
        os.kill(old, signal.SIGKILL)
        written = sum(e.num_blocks for e in recorder.events("BLOCK_OFFLOADED") if e.write_through)
        finished = []
        deadline = time.monotonic() + DEADLINE
        while not finished:
            assert time.monotonic() < deadline, "the request did not finish"
            finished = [output for output in client.poll(100) if output.finished]
        assert gone(old) and finished[0].error is None
        assert finished[0].outputs[0].token_ids == expected, "the resumed request's greedy tokens"
        resumed = recorder.wait_for("RESUMED", "long")
        restored = sum(e.num_blocks for e in recorder.events("BLOCK_RESTORED"))
        recomputed = num_prompt - resumed.num_cached_tokens  # prompt tokens computed again after the restart
        print(f"\nwritten through before the kill: {written} blocks; restored {restored}; recomputed "
              f"{recomputed} of {num_prompt} prompt tokens")
        assert 0 < restored <= written and resumed.num_cached_tokens == restored * 16
        assert recomputed < num_prompt
        until(lambda: all_ready(group), "every actor ready")
    finally:
        client.close()


def test_past_the_budget_the_group_fails_tells_its_listeners_and_stops(tiny_qwen3: Path) -> None:
    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", num_gpu_blocks_override=32)
    group = ProcessGroup(config, max_restarts=1).start()
    restarted: list[str] = []
    reasons: list[str] = []
    failed = threading.Event()
    group.on_restart(restarted.append)
    group.on_failure(lambda reason: (reasons.append(reason), failed.set()))
    recorder = BusRecorder(group.addresses.bus_out, group.addresses.bus_in)
    first_pids = group.pids()
    try:
        os.kill(first_pids["scheduler"], signal.SIGKILL)
        until(lambda: restarted == ["scheduler"], "the restart listener told of the scheduler")
        assert group.state()["scheduler"] == "ready"
        group.raise_if_dead()
        second = group.pids()["scheduler"]
        os.kill(second, signal.SIGKILL)
        assert failed.wait(DEADLINE), "the failure listener was not called"
        assert "restart budget spent" in reasons[0] and "scheduler exited (killed by SIGKILL)" in reasons[0]
        assert group.wait_stopped(DEADLINE), "the group did not shut itself down"
        assert all(gone(pid) for pid in [*first_pids.values(), second]), group.pids()
        assert not group.alive() and group.failed == reasons[0]
        assert group.state()["scheduler"] == "failed"
        assert set(group.state().values()) == {"failed", "stopped"}
        with pytest.raises(ActorDiedError, match="scheduler"):
            group.raise_if_dead()
        until(lambda: recorder.events("GROUP_FAILED"), "GROUP_FAILED on the bus")
        assert recorder.events("GROUP_FAILED")[0].reason == reasons[0]
        late: list[str] = []
        group.on_failure(late.append)  # a listener registered too late is told at once
        assert late == reasons
    finally:
        recorder.close()
        group.shutdown()


def test_run_dirs_of_dead_owners_are_swept_by_the_next_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor killed with SIGKILL leaves its run directory (sockets, logs, CURVE keys): the
    next run directory made under the same root removes it; live owners' and unowned ones stay."""
    from vllm_actors.runtime.run_dir import OWNER_FILE, make_run_dir

    monkeypatch.setenv("VLLM_ACTORS_RUN_ROOT", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan, alive, unowned = make_run_dir(), make_run_dir(), tmp_path / "gbeing-made"
    (orphan / OWNER_FILE).write_text(str(dead.pid))
    (orphan / "curve.keys").write_text("secret")
    unowned.mkdir()
    assert (alive / OWNER_FILE).read_text() == str(os.getpid())
    newest = make_run_dir()
    assert not orphan.exists()
    assert alive.is_dir() and unowned.is_dir() and newest.is_dir()
