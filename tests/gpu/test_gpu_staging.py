"""On a GPU: the pinned staging sets are refilled only once the device has run their copies
(runner/staging.py). Device work queued ahead (``torch.cuda._sleep``) holds every copy back while
the host uploads several steps through the same two sets; each step's inputs are then cloned on
the device, in stream order after its copy. Without the fences the host would refill a set whose
copy is still queued, and an early step would see a later step's inputs."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.runner.graph_inputs import GraphInputs
from vllm_actors.runner.step_inputs import StepStaging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS, ROWS, BLOCK = 6, 8, 16
BUSY_CYCLES = 100_000_000  # tens of milliseconds of device time, far more than the host's uploads take


def _decode(step: int) -> BatchInput:
    return BatchInput(token_ids=[100 + step] * ROWS, positions=[step] * ROWS, query_lens=[1] * ROWS,
                      seq_lens=[step + 1] * ROWS, block_tables=[[row] for row in range(ROWS)],
                      logits_indices=list(range(ROWS)))


def test_decode_graph_inputs_of_each_step_reach_a_busy_device_intact() -> None:
    device = torch.device("cuda")
    inputs = GraphInputs(ROWS, 4, BLOCK, device)
    seen = []
    torch.cuda.synchronize(device)
    torch.cuda._sleep(BUSY_CYCLES)
    for step in range(STEPS):
        inputs.upload(_decode(step), ROWS, None)
        seen.append((inputs.device["input_ids"][:ROWS].clone(), inputs.device["positions"][:ROWS].clone()))
    torch.cuda.synchronize(device)
    assert [(ids.tolist(), pos.tolist()) for ids, pos in seen] == \
        [([100 + step] * ROWS, [step] * ROWS) for step in range(STEPS)]


def test_step_inputs_of_each_step_reach_a_busy_device_intact() -> None:
    device = torch.device("cuda")
    staging = StepStaging(device, max_num_tokens=64, max_num_seqs=ROWS, block_size=BLOCK, width=4)
    seen = []
    torch.cuda.synchronize(device)
    torch.cuda._sleep(BUSY_CYCLES)
    for step in range(STEPS):
        host = staging.fill(_decode(step), ROWS, 4)
        on_device = {name: tensor.to(device, non_blocking=True) for name, tensor in host.items()}
        staging.enqueued()
        seen.append((on_device["input_ids"], on_device["seq_lens"]))
    torch.cuda.synchronize(device)
    assert [(ids.tolist(), lens.tolist()) for ids, lens in seen] == \
        [([100 + step] * ROWS, [step + 1] * ROWS) for step in range(STEPS)]
