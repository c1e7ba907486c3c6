"""vllm_actors: an LLM inference and serving engine built as an event-driven actor system."""

import structlog as _structlog

from vllm_actors.actors.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.protocol.sampling import SamplingParams, StructuredOutputs, StructuredOutputsParams
from vllm_actors.runtime.log_setup import configure_logging as _configure_logging

__version__ = "0.1.0"

# structlog's unconfigured default prints to stdout; unless the host application configured it,
# log key=value lines to stderr at VLLM_ACTORS_LOG_LEVEL (default WARNING).
if not _structlog.is_configured():
    _configure_logging()
__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "LoRARequest", "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing the package must not import torch
    if name == "LLM":
        from vllm_actors.llm import LLM

        return LLM
    raise AttributeError(f"module 'vllm_actors' has no attribute {name!r}")
