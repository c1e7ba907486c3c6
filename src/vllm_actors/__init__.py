"""vllm_actors: an LLM inference and serving engine built as an event-driven actor system."""

from vllm_actors.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_actors.protocol.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing the package must not import torch
    if name == "LLM":
        from vllm_actors.llm import LLM

        return LLM
    raise AttributeError(f"module 'vllm_actors' has no attribute {name!r}")
