"""Moved to ``vllm_actors.runner.settings``: this re-export serves
runtime/actor_main.py and clients/inprocess.py until they call
``vllm_actors.runner.build.build_worker``; delete it then."""

from vllm_actors.runner.settings import defer_steps, tp_graph_draws

__all__ = ["defer_steps", "tp_graph_draws"]
