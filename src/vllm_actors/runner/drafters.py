"""The drafter a target's runner holds for speculative decoding (``ModelRunner.drafter``): a draft
model's runner (``draft_model.py``), an EAGLE-3 head's (``eagle3.py``), or none (n-gram, or no
speculation)."""

from __future__ import annotations

from typing import Any

from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runner.draft_model import draft_config
from vllm_actors.runner.eagle3 import Eagle3Runner


def make_drafter(config: EngineConfig, target: Any, max_model_len: int, runner_class: type) -> Any:
    """Built once the target's weights are loaded and before it sizes its pool (which counts the
    drafter's bytes per block); ``runner_class``: ``ModelRunner``, for a draft model."""
    spec = config.speculative_config
    if spec is not None and spec.method == "eagle3" and spec.model is not None:
        return Eagle3Runner(spec.model, target)
    drafting = draft_config(config, target.model_config, max_model_len, str(target.device))
    return runner_class(drafting) if drafting is not None else None


def reattach(drafter: Any, model: Any) -> None:
    """An EAGLE-3 head's hook on the target's model again (after its weights were reloaded)."""
    if isinstance(drafter, Eagle3Runner):
        drafter.attach(model)
