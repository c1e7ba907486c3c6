"""VLLM_ACTORS_PROFILE_STEPS: every worker profiles the same window of step plans and writes its
own Chrome trace and table (runtime/step_profiler.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.runtime.profile_timeline import device_bursts, format_bursts, format_marginals, marginal_times
from vllm_actors.runtime.step_profiler import ProfiledWorker, Profiler, ProfileWindow, profiled
from vllm_actors.runtime.transport import Deferring


def _plan(step_id: int) -> StepPlan:
    return StepPlan(step_id=step_id, req_ids=[], num_tokens=[], num_blocks=[], new_block_ids=[])


class _Worker:
    name = "worker"

    def __init__(self) -> None:
        self.handled: list[Any] = []

    def handle(self, message: Any) -> Outputs:
        self.handled.append(message)
        return Outputs(messages=[("scheduler", message)])

    def has_pending(self) -> bool:
        return True

    def pending_ready(self) -> bool:
        return False

    def flush(self) -> Outputs:
        return Outputs(messages=[("scheduler", "flushed")])


class _FakeProfiler:
    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def start(self) -> None:
        self.log.append("start")

    def stop(self, stem: Path) -> list[Path]:
        self.log.append(f"stop {stem.name}")
        if self.fail:
            raise OSError("disk full")
        return [stem]


def test_the_window_comes_from_the_environment(tmp_path: Path) -> None:
    assert ProfileWindow.from_env({}) is None
    window = ProfileWindow.from_env({"VLLM_ACTORS_PROFILE_STEPS": "200:8", "VLLM_ACTORS_PROFILE_DIR": str(tmp_path)})
    assert window == ProfileWindow(200, 8, tmp_path)
    default_dir = ProfileWindow.from_env({"VLLM_ACTORS_PROFILE_STEPS": "3:1"})
    assert default_dir == ProfileWindow(3, 1, Path("vllm-actors-profiles"))
    for bad in ("8", "a:b", "5:0", "-1:3"):
        with pytest.raises(ValueError, match="VLLM_ACTORS_PROFILE_STEPS must be FIRST:COUNT"):
            ProfileWindow.from_env({"VLLM_ACTORS_PROFILE_STEPS": bad})
    worker = _Worker()
    assert profiled(worker, {}, "worker-0") is worker


def test_the_window_covers_count_plans_from_the_first_and_the_worker_is_unchanged(tmp_path: Path) -> None:
    log: list[str] = []
    worker = _Worker()
    wrapped = ProfiledWorker(worker, ProfileWindow(2, 3, tmp_path), "r1/worker-0", lambda: _FakeProfiler(log))
    for step in range(7):
        assert wrapped.handle(_plan(step)) == Outputs(messages=[("scheduler", _plan(step))])
        if step == 1:
            assert log == []
        if step == 2:
            assert log == ["start"]
    assert log == ["start", "stop r1_worker-0-steps-2-4"]  # once, with a file name from the actor's id
    assert [plan.step_id for plan in worker.handled] == list(range(7))
    assert wrapped.has_pending() and wrapped.name == "worker"  # the rest is the worker's own
    # the worker's deferred steps stay visible to the loop through the wrapper
    assert isinstance(wrapped, Deferring) and not wrapped.pending_ready()
    assert wrapped.flush() == Outputs(messages=[("scheduler", "flushed")])
    assert wrapped.written == [tmp_path / "r1_worker-0-steps-2-4"]


def test_a_restarted_schedulers_step_ids_count_from_its_incarnation(tmp_path: Path) -> None:
    log: list[str] = []
    wrapped = ProfiledWorker(_Worker(), ProfileWindow(5, 1, tmp_path), "worker-0", lambda: _FakeProfiler(log))
    first = 3 << 40
    for step in range(first, first + 7):
        wrapped.handle(_plan(step))
    assert log == ["start", f"stop worker-0-steps-{first + 5}-{first + 5}"]


def test_a_profile_that_cannot_be_written_leaves_the_worker_serving(tmp_path: Path) -> None:
    log: list[str] = []
    worker = _Worker()
    wrapped = ProfiledWorker(worker, ProfileWindow(0, 1, tmp_path), "worker-0", lambda: _FakeProfiler(log, fail=True))
    for step in range(3):
        wrapped.handle(_plan(step))
    assert log == ["start", "stop worker-0-steps-0-0"] and len(worker.handled) == 3 and wrapped.written == []


def test_the_profiler_writes_a_chrome_trace_and_a_table(tmp_path: Path) -> None:
    profiler = Profiler()
    profiler.start()
    torch.ones(64, 64) @ torch.ones(64, 64)
    trace, table = profiler.stop(tmp_path / "worker-0-steps-1-2")
    assert trace.name == "worker-0-steps-1-2.json.gz" and table.name == "worker-0-steps-1-2-top.txt"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(event.get("name") == "aten::mm" for event in events)
    assert "aten::mm" in table.read_text()
    assert table.read_text().startswith("device timeline: no device events (CPU profile)")


def test_the_device_timeline_splits_bursts_at_idle_gaps() -> None:
    """Two steps of three kernels each with 0.5 ms of idle between them (the batch-1 pipeline that
    kept one step in flight), host events ignored; then the same steps back to back."""
    def kernel(ts: float, dur: float) -> dict[str, Any]:
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}

    host = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 50.0, "dur": 5000.0}
    step = [(0.0, 1000.0), (1001.0, 2000.0), (3002.0, 998.0)]  # 4 ms span, 3.998 ms of kernels
    idle = [kernel(1e6 + ts, dur) for ts, dur in step] + [kernel(1e6 + 4500 + ts, dur) for ts, dur in step] + [host]
    first, second = device_bursts(idle)
    assert (first.span_us, first.busy_us, first.num_events, first.idle_before_us) == (4000.0, 3998.0, 3, 0.0)
    assert (second.start_us, second.idle_before_us) == (4500.0, 500.0)
    text = format_bursts([first, second])
    assert "idle between bursts 0.500 ms (5.9%)" in text and "gaps inside bursts 0.004 ms" in text
    back_to_back = [kernel(ts, dur) for ts, dur in step] + [kernel(4001.0 + ts, dur) for ts, dur in step]
    (only,) = device_bursts(back_to_back)
    assert only.num_events == 6 and only.idle_before_us == 0.0
    assert device_bursts([host]) == []


def test_marginal_times_charge_each_kernel_what_it_adds_also_when_kernels_overlap() -> None:
    """A GEMV launched early (its clock runs from 0 while an all-reduce runs 2..6) ends at 10: it is
    charged 4, the all-reduce 6 (from its start, the burst's first end), a norm after a 1 us gap 3;
    a second burst after 500 us of idle charges its kernel its own duration; the charges add up to
    the spans; host events are ignored."""
    def kernel(name: str, ts: float, dur: float) -> dict[str, Any]:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [kernel("allreduce", 0.0, 6.0), kernel("gemv", 2.0, 8.0), kernel("norm", 11.0, 2.0),
              kernel("gemv", 513.0, 5.0), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 99.0}]
    got = {m.name: (m.count, m.total_us) for m in marginal_times(events)}
    assert got == {"gemv": (2, 4.0 + 5.0), "allreduce": (1, 6.0), "norm": (1, 3.0)}
    assert [m.name for m in marginal_times(events)] == ["gemv", "allreduce", "norm"]
    spans = sum(b.span_us for b in device_bursts(events))
    assert sum(m.total_us for m in marginal_times(events)) == spans == 18.0
    text = format_marginals(marginal_times(events))
    assert "gemv" in text.splitlines()[2] and "50.0%" in text
    assert format_marginals([]) == ""


def test_every_rank_of_a_group_profiles_the_same_steps(tiny_qwen3_tp: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2 over gloo, real processes: worker-0 and worker-1 each write their trace of steps 2-3."""
    from vllm_actors import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ACTORS_PROFILE_STEPS", "2:2")
    monkeypatch.setenv("VLLM_ACTORS_PROFILE_DIR", str(tmp_path))
    with LLM(str(tiny_qwen3_tp), executor="group", tensor_parallel_size=2, dtype="float32",
             num_gpu_blocks_override=16, block_size=8) as llm:
        outputs = llm.generate([{"prompt_token_ids": [3, 5, 7, 11]}],
                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(outputs[0].outputs[0].token_ids) == 8
    traces = sorted(path.name for path in tmp_path.glob("*.json.gz"))
    assert len(traces) == 2 and traces[0].startswith("worker-0-steps-") and traces[1].startswith("worker-1-steps-")
    assert traces[0].removeprefix("worker-0") == traces[1].removeprefix("worker-1")  # the same steps on both
    for trace in tmp_path.glob("*.json.gz"):
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        assert any(str(event.get("name", "")).startswith("aten::") for event in events)
    assert len(list(tmp_path.glob("*-top.txt"))) == 2
