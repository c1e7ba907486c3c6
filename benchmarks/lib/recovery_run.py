"""One timed run of the recovery benchmark: the requests driven through the engine's client, a
worker SIGKILLed once enough tokens are out, the token arrivals and the supervisor's restarts
timed, every wait bounded."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.protocol.names import worker_id
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime.run_dir import pid_alive

KILL_ROLES = ("rank", "stage")


def victim_actor(role: str, index: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> str:
    """The worker to kill: ``rank``: tensor-parallel rank ``index`` of the first stage; ``stage``:
    pipeline stage ``index`` (its first tensor-parallel rank). Worker ranks run stage by stage,
    ``tensor_parallel_size`` ranks each (``models.pipeline.make_stage``)."""
    if role == "rank":
        if not 0 <= index < tensor_parallel_size:
            raise ValueError(f"--kill-index {index}: a tensor-parallel rank from 0 to {tensor_parallel_size - 1} "
                             f"(--tensor-parallel-size {tensor_parallel_size})")
        return worker_id(index)
    if role == "stage":
        if not 0 <= index < pipeline_parallel_size:
            raise ValueError(f"--kill-index {index}: a pipeline stage from 0 to {pipeline_parallel_size - 1} "
                             f"(--pipeline-parallel-size {pipeline_parallel_size})")
        return worker_id(index * tensor_parallel_size)
    raise ValueError(f"--kill-role {role!r}: one of {', '.join(KILL_ROLES)}")


@dataclass
class Restarts:
    """The supervisor's restarts as they come (``ProcessGroup.on_restart``: an actor READY again)."""

    seen: list[tuple[str, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, actor: str) -> None:
        with self.lock:
            self.seen.append((actor, time.monotonic()))

    def since(self, moment: float) -> dict[str, float]:
        """Each actor restarted after ``moment``: when it was READY again."""
        with self.lock:
            return {actor: at for actor, at in self.seen if at >= moment}


@dataclass
class Kill:
    victim: str
    after_tokens: int
    pid: int = 0
    at: float = 0.0
    unit: dict[str, int] = field(default_factory=dict)  # the replica's workers' pids before the kill
    respawned: float | None = None  # the victim's new process started (the old unit is gone by then)

    def watch_respawn(self, group: Any, deadline: float) -> None:
        """Note when the victim has a new process (``pids()`` changes once the old unit is killed)."""
        while time.monotonic() < deadline:
            if group.pids().get(self.victim) != self.pid:
                self.respawned = time.monotonic()
                return
            time.sleep(0.005)


def timed_run(llm: Any, prompts: list[dict[str, list[int]]], params: SamplingParams, kill: Kill | None,
              timeout: float, tag: str) -> dict[str, Any]:
    """Submit every prompt, poll until all have finished or ``timeout`` seconds have passed (then
    abort the rest: ``hung``), SIGKILLing ``kill.victim`` once ``kill.after_tokens`` tokens are out."""
    engine = llm.engine
    ids = [f"{tag}-{index}" for index in range(len(prompts))]
    tokens = dict.fromkeys(ids, 0)
    finished: dict[str, Any] = {}
    arrivals: list[float] = []  # when an output brought new tokens
    watcher: threading.Thread | None = None
    started = time.monotonic()
    deadline = started + timeout
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.submit(engine.prepare(request_id, prompt, params))
    while len(finished) < len(ids) and time.monotonic() < deadline and engine.has_unfinished:
        for output in engine.poll(100):
            if output.request_id not in tokens:
                continue
            count = len(output.outputs[0].token_ids) if output.outputs else 0
            if count > tokens[output.request_id]:
                tokens[output.request_id] = count
                arrivals.append(time.monotonic())
            if output.finished:
                finished[output.request_id] = output
        if kill is not None and not kill.at and sum(tokens.values()) >= kill.after_tokens:
            kill.unit = {actor: pid for actor, pid in llm.group.pids().items() if actor.startswith("worker-")}
            kill.pid = kill.unit[kill.victim]
            kill.at = time.monotonic()
            os.kill(kill.pid, signal.SIGKILL)
            watcher = threading.Thread(target=kill.watch_respawn, args=(llm.group, deadline), daemon=True)
            watcher.start()
    hung = len(finished) < len(ids)
    for request_id in set(ids) - set(finished):
        engine.abort(request_id)
    if watcher is not None:
        watcher.join(timeout=1)
    outputs = [finished.get(request_id) for request_id in ids]
    return {
        "wall_seconds": time.monotonic() - started,
        "hung": hung,
        "outputs": [list(output.outputs[0].token_ids) if output is not None else [] for output in outputs],
        "finish_reasons": [output.outputs[0].finish_reason if output is not None else None for output in outputs],
        "arrivals": arrivals,
    }


def kill_report(run: dict[str, Any], kill: Kill, restarts: Restarts, reference: dict[str, Any],
                output_len: int, settle: float = 10.0) -> dict[str, Any]:
    """What the kill cost: seconds from the signal to the victim's new process, to each restarted
    actor READY (the supervisor's restarts) and to the first token generated again; requests lost
    (not finished with ``output_len`` tokens); the old unit's processes still alive ``settle``
    seconds on (a surviving peer stuck in a collective would be one)."""
    if not kill.at:
        why = "hung (not finished within --timeout)" if run["hung"] else "ended"
        return {"victim": kill.victim, "killed": False, "hung": run["hung"],
                "error": f"the run {why} before {kill.after_tokens} tokens were out: nothing was killed"}
    ready = restarts.since(kill.at)
    after_respawn = [at for at in run["arrivals"] if kill.respawned is not None and at >= kill.respawned]
    settle_until = time.monotonic() + settle
    left = [actor for actor, pid in kill.unit.items() if pid_alive(pid)]
    while left and time.monotonic() < settle_until:
        time.sleep(0.05)
        left = [actor for actor, pid in kill.unit.items() if pid_alive(pid)]
    lost = sum(reason != "length" or len(tokens) != output_len
               for reason, tokens in zip(run["finish_reasons"], run["outputs"], strict=True))

    def since_kill(moment: float | None) -> float | None:
        return None if moment is None else round(moment - kill.at, 3)

    return {
        "victim": kill.victim,
        "killed": True,
        "respawn_seconds": since_kill(kill.respawned),
        "ready_seconds": {actor: since_kill(at) for actor, at in sorted(ready.items())},
        "all_back_seconds": since_kill(max(ready.values())) if ready else None,
        "serving_again_seconds": since_kill(after_respawn[0]) if after_respawn else None,
        "old_processes_alive": left,
        "requests_lost": lost,
        "identical_outputs": sum(a == b for a, b in zip(run["outputs"], reference["outputs"], strict=True)),
        "wall_seconds": round(run["wall_seconds"], 3),
        "extra_seconds": round(run["wall_seconds"] - reference["wall_seconds"], 3),
        "hung": run["hung"],
    }
