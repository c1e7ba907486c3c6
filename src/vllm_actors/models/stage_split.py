"""The layers of each pipeline stage (no torch here: the supervisor checks the split before it starts
any process)."""

from __future__ import annotations

from vllm_actors.envs import envs
from vllm_actors.models.config import ModelConfig


def stage_layers(num_layers: int, num_stages: int, partition: str | None = None) -> list[tuple[int, int]]:
    """Each stage's layers ``[start, end)``. ``partition``: the layer count of each stage,
    comma-separated (vLLM's ``VLLM_PP_LAYER_PARTITION``); None: an even split."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size {num_stages} is larger than the model's {num_layers} layers: "
                         "every stage needs at least one layer")
    if partition is None or not partition.strip():
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
    else:
        try:
            counts = [int(part) for part in partition.split(",")]
        except ValueError:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION must be layer counts separated by commas, got {partition!r}") \
                from None
        if len(counts) != num_stages or any(count < 1 for count in counts) or sum(counts) != num_layers:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION {partition!r} must give {num_stages} positive layer counts "
                             f"(one per pipeline stage) summing to the model's {num_layers} layers")
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def check_stages(model: str, num_stages: int) -> None:
    """Raise ``ValueError`` where ``model`` cannot be cut into ``num_stages`` stages (fewer layers,
    or a ``VLLM_PP_LAYER_PARTITION`` that does not fit)."""
    if num_stages > 1:
        stage_layers(ModelConfig.from_path(model).num_hidden_layers, num_stages, envs.VLLM_PP_LAYER_PARTITION)
