"""Moved to ``vllm_actors.runner.model_runner``: this re-export serves
runtime/actor_main.py and clients/inprocess.py until they call
``vllm_actors.runner.build.build_worker``; delete it then."""

from vllm_actors.runner.model_runner import ModelRunner, resolve_device

__all__ = ["ModelRunner", "resolve_device"]
