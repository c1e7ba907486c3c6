"""The vLLM and SGLang sides of ``benchmarks/long_context.py``: each engine's adapter to the measurement
loop of ``long_context_run.py``. Runs as a script under the peer's environment (its packages apart, e.g.
/tmp/vsite or /tmp/ssite), beside a copy of long_context_run.py (``long_context_process.copy_peer_script``),
importing nothing of vllm_actors: ``python3 peer_long.py --engine vllm|sglang --model DIR --contexts 16384
131072 --repeats 3 3 --warmup 1 1 --out R.json``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:  # the project's checkout
    from benchmarks.lib import long_context_run as run
except ImportError:  # a copy run by the peer's Python, beside its copy of long_context_run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import long_context_run as run  # type: ignore[no-redef]

TEMPERATURE, Events = run.TEMPERATURE, run.Events


# --------------------------------------------------------------------------- the peers
def sglang_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """vLLM's "fp8" is e4m3; SGLang spells it out."""
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def sglang_completion_tokens(chunk: Any) -> int:
    """Tokens so far in one streamed SGLang chunk (a dict, or a list of one)."""
    item = chunk[0] if isinstance(chunk, list) else chunk
    meta = item.get("meta_info") or {}
    if "completion_tokens" in meta:
        return int(meta["completion_tokens"])
    return len(item.get("output_ids") or [])


def as_plain_dict(settings: Any) -> dict[str, Any]:
    """An engine's settings object (a dataclass, or anything with a ``resolved_dict``) as a dict."""
    if hasattr(settings, "resolved_dict"):
        return dict(settings.resolved_dict())
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
    return dict(vars(settings))


class VllmEngine:
    name = "vllm"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.llm: Any = None
        self.ids = 0

    def start(self) -> dict[str, Any]:
        import vllm
        from vllm import LLM

        a = self.args
        kwargs = {"model": a.model, "load_format": a.load_format, "dtype": a.dtype, "max_model_len": a.max_model_len,
                  "enable_prefix_caching": True, "tensor_parallel_size": a.tensor_parallel_size,
                  "kv_cache_dtype": a.kv_cache_dtype, "gpu_memory_utilization": a.gpu_memory_utilization,
                  "skip_tokenizer_init": True, "seed": a.seed}
        if a.pipeline_parallel_size > 1:
            kwargs["pipeline_parallel_size"] = a.pipeline_parallel_size
        if a.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = a.max_num_batched_tokens
        if a.block_size:
            kwargs["block_size"] = a.block_size
        self.llm = LLM(**kwargs)
        settings: dict[str, Any] = {"version": vllm.__version__, "arguments": kwargs}
        try:  # what vLLM resolved (attribute names move between versions)
            config = self.llm.llm_engine.vllm_config
            settings["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
            settings["max_num_seqs"] = config.scheduler_config.max_num_seqs
            settings["block_size"] = config.cache_config.block_size
            settings["num_gpu_blocks"] = config.cache_config.num_gpu_blocks
            settings["cache_dtype"] = config.cache_config.cache_dtype
            settings["vllm_config"] = str(config)
        except Exception as error:
            settings["resolved_error"] = f"{type(error).__name__}: {error}"
        return settings

    @staticmethod
    def _params(max_tokens: int) -> Any:
        from vllm import SamplingParams

        try:  # an update every step (LLM.generate may ask for the final output only)
            from vllm.sampling_params import RequestOutputKind

            kind: dict[str, Any] = {"output_kind": RequestOutputKind.CUMULATIVE}
        except ImportError:
            kind = {}
        return SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=max_tokens, detokenize=False,
                              **kind)

    def stream(self, prompt: list[int], max_tokens: int) -> Events:
        return self.stream_batch([prompt], max_tokens)[0]

    def stream_batch(self, prompts: list[list[int]], max_tokens: int) -> list[Events]:
        """The prompts added at once, then stepped to their ends: each one's token arrivals."""
        params = self._params(max_tokens)
        engine = self.llm.llm_engine
        ids = []
        start = time.perf_counter()
        for prompt in prompts:
            self.ids += 1
            ids.append(f"long-{self.ids}")
            engine.add_request(ids[-1], {"prompt_token_ids": prompt}, params)
        events: dict[str, Events] = {request_id: [] for request_id in ids}
        while engine.has_unfinished_requests():
            for output in engine.step():
                got = events.get(output.request_id)
                count = len(output.outputs[0].token_ids)
                if got is not None and (not got or count > got[-1][1]):
                    got.append((time.perf_counter() - start, count))
        return [events[request_id] for request_id in ids]

    def admit(self, prompt: list[int], seconds: float) -> str | None:
        """The prompt added (vLLM refuses one it cannot hold there, or at its start for max_model_len),
        left to its engine core for ``seconds``, then aborted; the refusal's text, or None."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        self.ids += 1
        request_id = f"admit-{self.ids}"
        try:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, detokenize=False))
        except Exception as error:
            return f"{type(error).__name__}: {error}"[:500]
        time.sleep(seconds)  # the engine core runs in its own process
        engine.abort_request([request_id])
        return None

    def shutdown(self) -> None:
        self.llm = None  # vLLM's LLM has no shutdown; the process ends next


class SglangEngine:
    name = "sglang"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine: Any = None

    def start(self) -> dict[str, Any]:
        import sglang

        a = self.args
        kwargs: dict[str, Any] = {
            "model_path": a.model, "load_format": a.load_format, "dtype": a.dtype, "context_length": a.max_model_len,
            "tp_size": a.tensor_parallel_size, "kv_cache_dtype": sglang_kv_cache_dtype(a.kv_cache_dtype),
            "attention_backend": "fa3", "sampling_backend": "pytorch", "skip_tokenizer_init": True,
            "random_seed": a.seed, "stream_interval": 1, "log_level": "error",
        }
        if a.pipeline_parallel_size > 1:
            kwargs["pp_size"] = a.pipeline_parallel_size
        if a.max_num_batched_tokens:
            kwargs["chunked_prefill_size"] = a.max_num_batched_tokens
        if a.mem_fraction_static is not None:
            kwargs["mem_fraction_static"] = a.mem_fraction_static
        if a.block_size:
            kwargs["page_size"] = a.block_size
        self.engine = sglang.Engine(**kwargs)
        return {"version": sglang.__version__, "arguments": kwargs,
                "server_args": as_plain_dict(self.engine.server_args)}

    def stream(self, prompt: list[int], max_tokens: int) -> Events:
        params = {"temperature": TEMPERATURE, "max_new_tokens": max_tokens, "ignore_eos": True}
        events: Events = []
        start = time.perf_counter()
        for chunk in self.engine.generate(input_ids=prompt, sampling_params=params, stream=True):
            count = sglang_completion_tokens(chunk)
            if count > (events[-1][1] if events else 0):
                events.append((time.perf_counter() - start, count))
        return events

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


PEERS: dict[str, Callable[[argparse.Namespace], run.Engine]] = {"vllm": VllmEngine, "sglang": SglangEngine}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return run.parse_args(argv, tuple(PEERS))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return run.run_engine(PEERS[args.engine](args), args)


if __name__ == "__main__":
    raise SystemExit(main())
