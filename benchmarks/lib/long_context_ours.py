"""Our engine's side of ``benchmarks/long_context.py``, in a process of its own like the peers':
``python -m benchmarks.lib.long_context_ours --engine ours ...`` (long_context_run.py's arguments). The
offline ``LLM``'s process group, driven through its client (``prepare``, ``submit``, ``poll``) so
that each token's arrival is timed as the peers' are."""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.lib.long_context_run import TEMPERATURE, Events, parse_args, run_engine


def engine_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM's arguments; the newer ones only when asked for, so older engines still run."""
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True, "dtype": args.dtype, "max_model_len": args.max_model_len, "seed": args.seed,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enable_prefix_caching": True,
    }
    if args.load_format != "auto":
        kwargs["load_format"] = args.load_format
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.pipeline_parallel_size > 1:
        kwargs["pipeline_parallel_size"] = args.pipeline_parallel_size
    if args.kv_parallel_size > 1:
        kwargs["kv_parallel_size"] = args.kv_parallel_size
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.block_size:
        kwargs["block_size"] = args.block_size
    return kwargs



def request_outputs(engine: Any, request: Any) -> Iterator[Any]:
    """Submit ``request`` to ``engine`` (the in-process client) and yield its outputs until the finished
    one; a failed request, or an engine gone idle without finishing it, raises; aborted on any exit
    before it finished (an error, or the caller's)."""
    engine.submit(request)
    try:
        while True:
            for output in engine.poll(100):
                if output.request_id != request.request_id:
                    continue
                if output.error is not None:
                    raise RuntimeError(f"request failed: {output.error}")
                yield output
                if output.finished:
                    return
            if not engine.has_unfinished:
                raise RuntimeError("the engine went idle with the request unfinished")
    except BaseException:
        engine.abort(request.request_id)
        raise


def started_settings(llm: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What an engine of ours was started with and what its group resolved (the scheduler's budget,
    the KV pool, the host tier), for a benchmark's results."""
    try:
        version = metadata.version("vllm-actors")
    except metadata.PackageNotFoundError:
        version = "source"
    settings = {"version": version, "arguments": kwargs, "max_model_len": llm.max_model_len,
                "engine_config": msgspec.to_builtins(llm.config)}
    scheduler = getattr(llm.group, "scheduler_config", None)
    if scheduler is not None:
        settings["scheduler_config"] = msgspec.to_builtins(scheduler)
    settings["worker"] = dict(getattr(llm.group, "worker_info", None) or {})
    return settings

class OursEngine:
    name = "ours"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.llm: Any = None
        self.ids = itertools.count()
        # with --trace-dir: long_context_run.run_engine streams each context's first sample through traced_stream
        self.traces: dict[int, dict[str, Any]] = {}
        if args.trace_dir is not None:
            self.traced_stream = self._traced_stream

    def start(self) -> dict[str, Any]:
        from vllm_actors.llm import LLM

        kwargs = engine_arguments(self.args)
        self.llm = LLM(model=self.args.model, **kwargs)
        return started_settings(self.llm, kwargs)

    def stream(self, prompt: list[int], max_tokens: int, request_id: str | None = None) -> Events:
        return self.stream_batch([prompt], max_tokens, None if request_id is None else [request_id])[0]

    def stream_batch(self, prompts: list[list[int]], max_tokens: int,
                     request_ids: list[str] | None = None) -> list[Events]:
        """The prompts submitted at once, polled to their ends: each one's token arrivals from the call (a
        failed one raises; every unfinished one is aborted on any exit before the end)."""
        from vllm_actors.protocol.sampling import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=max_tokens)
        start = time.perf_counter()
        ids = request_ids or [f"long-{next(self.ids)}" for _ in prompts]
        requests = [engine.prepare(i, {"prompt_token_ids": p}, params) for i, p in zip(ids, prompts, strict=True)]
        events: dict[str, Events] = {request.request_id: [] for request in requests}
        open_ids = set(events)
        try:
            for request in requests:
                engine.submit(request)
            while open_ids:
                for output in engine.poll(100):
                    got = events.get(output.request_id)
                    if got is None:
                        continue
                    if output.error is not None:
                        raise RuntimeError(f"request failed: {output.error}")
                    count = len(output.outputs[0].token_ids)
                    if not got or count > got[-1][1]:
                        got.append((time.perf_counter() - start, count))
                    if output.finished:
                        open_ids.discard(output.request_id)
                if open_ids and not engine.has_unfinished:
                    raise RuntimeError("the engine went idle with requests of the batch unfinished")
        finally:
            for request_id in open_ids:
                engine.abort(request_id)
        return [events[request.request_id] for request in requests]

    def admit(self, prompt: list[int], seconds: float) -> str | None:
        """The prompt submitted and polled for ``seconds`` (a refusal comes back as the request's
        error at once), then aborted; the refusal's text, or None."""
        from vllm_actors.protocol.sampling import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=1)
        request = engine.prepare(f"admit-{next(self.ids)}", {"prompt_token_ids": prompt}, params)
        engine.submit(request)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                for output in engine.poll(100):
                    if output.request_id == request.request_id and output.error is not None:
                        return str(output.error)[:500]
                    if output.request_id == request.request_id and output.finished:
                        return None  # served whole within the time (a short context)
        finally:
            engine.abort(request.request_id)
        return None

    def _traced_stream(self, context: int, prompt: list[int], max_tokens: int) -> Events:
        """``stream``, then the request's events from the metrics store: its trace file under
        ``--trace-dir`` and its chunk table in ``traces[context]`` (an error there if that failed)."""
        from benchmarks.lib.long_context_trace import capture, events_index

        query = self.llm.engine.query_metrics
        since = events_index(query)
        request_id = f"long-{next(self.ids)}"
        events = self.stream(prompt, max_tokens, request_id)
        path = Path(self.args.trace_dir) / f"trace-ours-{context}.json.gz"
        try:
            self.traces[context] = capture(query, since, request_id, self.args.pipeline_parallel_size, path)
        except Exception as error:  # the sample stands without its trace
            self.traces[context] = {"error": f"{type(error).__name__}: {error}"}
        return events

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging()  # VLLM_ACTORS_LOG_LEVEL's level
    args = parse_args(argv, engines=("ours",))
    return run_engine(OursEngine(args), args)


if __name__ == "__main__":
    raise SystemExit(main())
