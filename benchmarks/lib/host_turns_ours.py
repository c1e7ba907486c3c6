"""Our engine's side of ``benchmarks/host_turns.py``, in a process of its own like vLLM's:
``python -m benchmarks.lib.host_turns_ours --engine ours --mode host ...`` (host_turns_peer.py's
arguments). The offline ``LLM``'s process group, driven through its client (``prepare``, ``submit``,
``poll``) so that the first token's arrival is timed as vLLM's is; mode ``host`` gives it the plan's
host memory as ``kv_cache_offload_gb``, mode ``recompute`` none. Its counters are the metrics
store's (``get_metrics``), read once the store has seen every request end and two readings agree
(the events travel on their own bus, each actor's apart)."""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.lib.host_turns_peer import Streamed, parse_args, run_cycles
from benchmarks.lib.long_context_ours import request_outputs, started_settings

# the metrics store's counters kept beside the four token figures
STORE_COUNTERS = ("requests_finished", "requests_aborted", "prompt_tokens", "prefill_tokens", "prompt_tokens_computed",
                  "prompt_tokens_cached", "prefix_cache_queries", "prefix_cache_hits", "kv_blocks_evicted",
                  "kv_blocks_offloaded", "kv_blocks_restored", "preemptions")
SETTLE_TIMEOUT_S = 60.0


def engine_arguments(args: argparse.Namespace, plan: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True, "dtype": args.dtype, "max_model_len": plan["context"], "seed": args.seed,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enable_prefix_caching": True,
        "block_size": plan["block_size"], "num_gpu_blocks_override": plan["pool_blocks"],
        "kv_cache_offload_gb": plan["host_gib"] if args.mode == "host" else 0.0,
    }
    if args.load_format != "auto":
        kwargs["load_format"] = args.load_format
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


def token_figures(store: Mapping[str, float], block_size: int) -> dict[str, float]:
    """The four token figures from the store's counters: computed (recomputation included), cached
    at admission, of them restored from the host tier (whole blocks) and found in the GPU pool."""
    restored = store["kv_blocks_restored"] * block_size
    return {"computed_tokens": store["prefill_tokens"], "cached_tokens": store["prompt_tokens_cached"],
            "restored_tokens": restored, "gpu_hit_tokens": store["prompt_tokens_cached"] - restored,
            "offloaded_tokens": store["kv_blocks_offloaded"] * block_size}


class OursTurns:
    name = "ours"

    def __init__(self, args: argparse.Namespace, plan: Mapping[str, Any]) -> None:
        self.args = args
        self.plan = plan
        self.llm: Any = None
        self.ids = itertools.count()
        self.sent = 0

    def start(self) -> dict[str, Any]:
        from vllm_actors.llm import LLM

        kwargs = engine_arguments(self.args, self.plan)
        self.llm = LLM(model=self.args.model, **kwargs)
        return started_settings(self.llm, kwargs)

    def stream(self, prompt: list[int], max_tokens: int) -> Streamed:
        from vllm_actors.protocol.sampling import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
        first: float | None = None
        start = time.perf_counter()
        request = engine.prepare(f"turns-{next(self.ids)}", {"prompt_token_ids": prompt}, params)
        self.sent += 1
        for output in request_outputs(engine, request):
            if output.outputs[0].token_ids and first is None:
                first = time.perf_counter() - start
        if first is None:
            raise RuntimeError("the request produced no token")
        return Streamed(first, time.perf_counter() - start, list(output.outputs[0].token_ids))

    def counters(self) -> dict[str, float]:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        previous: dict[str, float] | None = None
        while True:
            summary = self.llm.get_metrics()
            current = {key: float(getattr(summary, key)) for key in STORE_COUNTERS}
            caught_up = current["requests_finished"] + current["requests_aborted"] >= self.sent
            if (caught_up and current == previous) or time.monotonic() > deadline:
                return {**current, **token_figures(current, self.plan["block_size"])}
            previous = current if caught_up else None
            time.sleep(0.05)

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging()  # VLLM_ACTORS_LOG_LEVEL's level
    args, plan = parse_args(argv, engines=("ours",))
    return run_cycles(OursTurns(args, plan), args, plan)


if __name__ == "__main__":
    raise SystemExit(main())
