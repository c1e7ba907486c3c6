"""Pipeline parallelism: a stage's place in the pipeline, its layers, and the point-to-point hand-over
of hidden states from stage to stage.

``P`` stages of ``T`` tensor-parallel ranks each: global rank ``g`` is rank ``g % T`` of stage
``g // T`` (on GPU ``g``). Stage ``s`` holds a contiguous range of the layers (``stage_layers``: an
even split, the first stages taking one more where it does not divide, or ``VLLM_PP_LAYER_PARTITION``),
the embedding on the first stage, the final norm, the LM head and the sampler on the last. A stage
before the last sends its output - the last layer's output (a rank's partial sum under TP) and the
residual stream, stacked ``[2, T, hidden]`` - to the same TP rank of the next stage, which receives
it for the same step (every stage gets every plan, so both know the token count): NCCL on GPUs, gloo
on the CPU, never the host's sockets. Sends are asynchronous: a stage takes its next step while the
next stage still receives (each send is waited for before the one after it). Hooks mark where a
step's own work starts (``received``: after its input is in) and ends (``sending``: before the send,
which may wait for the previous one): the worker's GPU step timer (``actors/worker/gpu_timing.py``)
leaves those waits out of the stage's time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vllm_actors.envs import envs
from vllm_actors.models.parallel import min_over_group
from vllm_actors.models.stage_split import stage_layers

_CHECKPOINT_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_ONLY = ("model.embed_tokens.",)
_LAST_ONLY = ("model.norm.", "lm_head.")


@dataclass(frozen=True)
class PipelineStage:
    """This worker's stage (``size == 1``: no pipeline; every layer, nothing sent)."""

    stage: int = 0
    size: int = 1
    start: int = 0  # its first layer
    end: int | None = None  # one past its last layer (None: the model's last)
    tp_size: int = 1
    tp_rank: int = 0
    group: Any = None  # the world group: every rank of every stage
    _sends: list[Any] = field(default_factory=list, compare=False)  # the send in flight and its tensor
    received: list[Callable[[], None]] = field(default_factory=list, compare=False)  # called after each recv
    sending: list[Callable[[], None]] = field(default_factory=list, compare=False)  # called before each send

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def global_rank(self) -> int:
        return self.stage * self.tp_size + self.tp_rank

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)

    def owns(self, name: str, num_layers: int) -> bool:
        """Whether this stage loads the checkpoint tensor ``name``."""
        match = _CHECKPOINT_LAYER.match(name)
        if match is not None:
            return int(match.group(1)) in self.layers(num_layers)
        if name.startswith(_FIRST_ONLY):
            return self.is_first
        if name.startswith(_LAST_ONLY):
            return self.is_last
        return True

    def send(self, hidden: torch.Tensor) -> None:
        """``hidden`` ([2, T, hidden]: output and residual) to the same TP rank of the next stage."""
        for hook in self.sending:
            hook()
        self.wait_sent()
        tensor = hidden.contiguous()
        work = dist.isend(tensor, dst=self.global_rank + self.tp_size, group=self.group)
        self._sends.append((work, tensor))  # kept alive until sent

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's [2, T, hidden] for this step."""
        tensor = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=device)
        dist.recv(tensor, src=self.global_rank - self.tp_size, group=self.group)
        for hook in self.received:
            hook()
        return tensor

    def wait_sent(self) -> None:
        while self._sends:
            work, _ = self._sends.pop(0)
            work.wait()

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest ``value`` over every rank of every stage (block ids mean the same everywhere)."""
        return min_over_group(value, device, self.group) if self.enabled else value


def make_stage(global_rank: int, tp_size: int, pp_size: int, num_layers: int, group: Any) -> PipelineStage:
    """The stage of ``global_rank`` with its layers (``VLLM_PP_LAYER_PARTITION`` or an even split)."""
    if pp_size == 1:
        return PipelineStage(tp_size=tp_size, tp_rank=global_rank % tp_size, group=group)
    stage = global_rank // tp_size
    start, end = stage_layers(num_layers, pp_size, envs.VLLM_PP_LAYER_PARTITION)[stage]
    return PipelineStage(stage=stage, size=pp_size, start=start, end=end, tp_size=tp_size,
                         tp_rank=global_rank % tp_size, group=group)


def run_stage(stage: PipelineStage, forward: Callable[[torch.Tensor | None], torch.Tensor], num_tokens: int,
              hidden_size: int, dtype: torch.dtype, device: torch.device,
              communicate: bool = True) -> torch.Tensor | None:
    """One step of this stage: ``forward`` over what the previous stage sent (the first stage: None),
    its output sent on to the next stage (None returned) or, on the last stage, returned.
    ``communicate=False`` (a profiling pass, alone on its stage): zeros in, nothing sent."""
    intermediate = None
    if not stage.is_first:
        intermediate = stage.recv(num_tokens, hidden_size, dtype, device) if communicate else \
            torch.zeros((2, num_tokens, hidden_size), dtype=dtype, device=device)
    out = forward(intermediate)
    if stage.is_last:
        return out
    if communicate:
        stage.send(out)
    return None
