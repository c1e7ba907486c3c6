"""Moved to ``vllm_actors.runner.grammar_tokenizer``: this re-export serves
runtime/actor_main.py and clients/inprocess.py until they call
``vllm_actors.runner.build.build_worker``; delete it then."""

from vllm_actors.runner.grammar_tokenizer import worker_grammars

__all__ = ["worker_grammars"]
