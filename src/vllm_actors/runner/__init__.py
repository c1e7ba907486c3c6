"""The GPU engine behind the worker's state machine: the model runner (KV cache, CUDA graphs,
padded forward passes), the sampler and its penalties, the grammars' masks, and ``build_worker``."""
