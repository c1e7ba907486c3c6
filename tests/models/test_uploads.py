"""The worker never makes the host wait for the GPU while it prepares and launches a step.

A blocking host-to-device copy (``torch.tensor(values, device=...)``, a CUDA tensor indexed with a
Python list) waits for everything queued on the stream: in the launch path that is the step just
launched, and the host's work on the next step stops overlapping the GPU's. The sampler did that in
every step of a batch whose penalised rows were not all of its rows (``_count_penalised``), as in
the json-penalties mix. On the CPU the rule is checked in the source; on a GPU,
under ``torch.cuda.set_sync_debug_mode("error")``, on the sampler itself.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_deferred_steps import _new
from vllm_actors.actors.worker.step_data import PendingStep, SamplingRow
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import StepStarted
from vllm_actors.protocol.messages import StepPlan, StepResult
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.model_runner import ModelRunner
from vllm_actors.runner.sampler import Sampler

SOURCE = Path(__file__).resolve().parents[2] / "src" / "vllm_actors"
WORKER_MODULES = [*(SOURCE / "actors" / "worker").glob("*.py"), *(SOURCE / "runner").glob("*.py")]


def _is_number(node: ast.expr) -> bool:
    """A literal, a negated one, or a module constant such as ``_MASK``."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) or (isinstance(node, ast.Name) and node.id.lstrip("_").isupper())


def _blocking_uploads(tree: ast.AST) -> list[int]:
    """Lines of ``torch.tensor(...)`` / ``torch.as_tensor(...)`` calls given a ``device``, of
    ``.to(...)`` calls to a device without ``non_blocking=True``, and of a number assigned through
    uploaded indices (``x[upload(...)] = 0.0``: index_put_ copies the number with a blocking copy)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_number(node.value):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and any(
                        isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "upload"
                        for inner in ast.walk(target.slice)):
                    lines.append(node.lineno)
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        keywords = {keyword.arg: keyword.value for keyword in node.keywords}
        if node.func.attr in ("tensor", "as_tensor") and "device" in keywords:
            lines.append(node.lineno)
        elif node.func.attr == "to" and node.args and isinstance(node.args[0], ast.Name) \
                and "device" in node.args[0].id:
            flag = keywords.get("non_blocking")
            if not (isinstance(flag, ast.Constant) and flag.value is True):
                lines.append(node.lineno)
    return lines


def test_no_worker_module_copies_to_the_device_with_a_blocking_copy() -> None:
    found = {}
    for path in sorted(WORKER_MODULES):
        if path.name == "uploads.py":
            continue
        lines = _blocking_uploads(ast.parse(path.read_text()))
        if lines:
            found[path.name] = lines
    assert not found, f"blocking host-to-device copies (use uploads.upload): {found}"


def test_the_rule_finds_what_it_looks_for() -> None:
    source = ("a = torch.tensor([1], device=d)\nb = x.to(device)\nc = x.to(device, non_blocking=True)\n"
              "e = torch.tensor([1]).to(self.device)\nf = x.to(torch.float32)\n"
              "x[upload(r, d), upload(c, d)] = _MASK\nx[upload(r, d)] = -1.0\nx[upload(r, d)] = y\nx[:n] = 0\n")
    assert sorted(_blocking_uploads(ast.parse(source))) == [1, 2, 6, 7]  # self.device: an attribute, not a name


def test_upload_gives_the_values_in_the_dtype() -> None:
    assert torch.equal(upload([3, 1, 2], torch.device("cpu")), torch.tensor([3, 1, 2]))
    floats = upload([0.5, 2.0], torch.device("cpu"), torch.float32)
    assert floats.dtype == torch.float32 and floats.tolist() == [0.5, 2.0]


def _mixed_rows(sampler: Sampler, tag: str) -> list[SamplingRow]:
    """Penalised rows with pool slots beside plain ones, greedy beside sampled, a seeded row, a
    min_tokens row, top-k, top-p and min-p rows, allowed ids, bad words and a logit bias: every
    path of ``draw`` that takes per-row lists."""
    rows = []
    for index in range(12):
        params = SamplingParams(temperature=0.0 if index % 3 == 0 else 0.8, max_tokens=16,
                                seed=7 if index == 4 else None, top_k=5 if index == 5 else 0,
                                min_tokens=4 if index == 6 else 0, presence_penalty=0.5 if index % 2 else 0.0,
                                repetition_penalty=1.1 if index % 2 else 1.0,
                                top_p=0.9 if index == 10 else 1.0, min_p=0.05 if index == 11 else 0.0,
                                allowed_token_ids=[5, 9, 11] if index == 7 else None,
                                bad_words_token_ids=[[4, 7], [9]] if index == 8 else [],
                                logit_bias={3: 5.0} if index == 9 else None)
        slot = sampler.penalties.add(f"{tag}{index}", [1, 2, 3], [4]) if params.has_penalties else -1
        rows.append(SamplingRow(params, num_output_tokens=1, min_tokens_stop_ids=[0, 1] if index == 6 else [],
                                token_ids=[1, 2, 3, 4], num_prompt_tokens=3, penalty_slot=slot))
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_drawing_a_mixed_batch_never_synchronises_on_a_gpu() -> None:
    device = torch.device("cuda")
    sampler = Sampler(device)
    vocab = 4096
    logits = torch.randn(12, vocab, device=device, dtype=torch.bfloat16)
    sampler.draw(logits, _mixed_rows(sampler, "warm"))  # compiles the kernels, grows the pool
    torch.cuda.synchronize()
    rows = _mixed_rows(sampler, "checked")
    torch.cuda.set_sync_debug_mode("error")
    try:
        chosen = sampler.draw(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert chosen.shape == (12,) and int(chosen.max()) < vocab


def _round(worker: Worker, tag: str, params: list[SamplingParams], first_step: int, first_block: int) -> int:
    """Prefill one request per ``params``, then three decode steps, each launched while the
    previous one is still pending; returns the next step id."""
    ids = [f"{tag}{index}" for index in range(len(params))]
    news = [_new(request_id, [3 + index, 5, 7, 11, 13], p) for index, (request_id, p) in enumerate(zip(ids, params))]
    plans = [StepPlan(step_id=first_step, new_requests=news, req_ids=ids, num_tokens=[5] * len(ids),
                      num_blocks=[1] * len(ids), new_block_ids=[[first_block + i] for i in range(len(ids))])]
    for step in range(1, 4):
        plans.append(StepPlan(step_id=first_step + step, req_ids=ids, num_tokens=[1] * len(ids),
                              num_blocks=[1] * len(ids), new_block_ids=[[] for _ in ids]))
    results = []
    for plan in plans:
        results += [m for m in worker.handle(plan).to(SCHEDULER) if isinstance(m, StepResult)]
    results += [m for m in worker.flush().to(SCHEDULER) if isinstance(m, StepResult)]
    assert [r.step_id for r in results] == [plan.step_id for plan in plans]
    assert all(len(r.token_ids) == len(ids) for r in results)
    finished = StepPlan(step_id=first_step + 4, finished_ids=ids, req_ids=[], num_tokens=[], num_blocks=[],
                        new_block_ids=[])
    worker.handle(finished)
    worker.flush()  # the finishing plan's (empty) result
    return first_step + 5


def _mixed_params() -> list[SamplingParams]:
    """As the json-penalties mix, without the grammar (its mask waits for the previous step's
    tokens by design): penalised rows beside plain ones, greedy, seeded, top-k and min_tokens."""
    return [SamplingParams(temperature=0.0 if index % 4 == 0 else 0.6, max_tokens=8, ignore_eos=True,
                           seed=3 if index == 5 else None, top_k=4 if index == 6 else 0,
                           min_tokens=2 if index == 7 else 0, presence_penalty=0.5 if index % 2 else 0.0,
                           frequency_penalty=0.5 if index % 2 else 0.0, repetition_penalty=1.1 if index % 2 else 1.0)
            for index in range(8)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_worker_launches_a_step_without_waiting_for_the_gpu(
        device: str, tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU this runs the same steps unchecked (so the harness is known good before a GPU
    runs it); on a GPU every launch runs under set_sync_debug_mode("error")."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    config = EngineConfig(model=str(tiny_qwen3), dtype="bfloat16" if device == "cuda" else "float32", device=device,
                          block_size=16, max_num_batched_tokens=128, max_num_seqs=8, max_model_len=64,
                          num_gpu_blocks_override=64)
    runner = ModelRunner(config)
    worker = Worker(runner, Sampler(runner.device), clock=lambda: 0.0, defer=True)
    if device == "cpu":
        monkeypatch.setattr(PendingStep, "ready", lambda self: False)  # as a busy GPU: launch before read back
    plain = [SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True) for _ in range(8)]
    step = _round(worker, "warm-plain", plain, 0, 0)  # compiles, captures, grows the penalty pool
    step = _round(worker, "warm-mixed", _mixed_params(), step, 8)
    launch = worker._launch
    launches = []

    def checked(plan: StepPlan, started: StepStarted, read_now: bool, **options: Any) -> PendingStep:
        if read_now:  # a step read back at once waits for its tokens by design
            return launch(plan, started, read_now, **options)
        launches.append(plan.step_id)
        if device != "cuda":
            return launch(plan, started, read_now, **options)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan, started, read_now, **options)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(worker, "_launch", checked)
    step = _round(worker, "plain", plain, step, 16)
    _round(worker, "mixed", _mixed_params(), step, 24)
    assert len(launches) == 10  # every plan of both rounds (5 each) went through the launch path
