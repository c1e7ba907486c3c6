"""``benchmarks/throughput.py --peer vllm``: vLLM's offline ``LLM`` on the same workload, in a
process of its own (vLLM's packages live apart from this engine's, e.g. in /tmp/vsite).

This file runs as a script under vLLM's environment, with peer_common.py beside it, and imports
nothing of vllm_actors: ``python3 peer_vllm.py --model DIR --workload W.json --out R.json``. It does
what the benchmark does to this engine (peer_common.run_workload): start the engine (timed), a
warm-up, ``--runs`` timed ``generate`` calls of the whole workload (temperature 0.6, ignore_eos),
then batch-1 by the client's clock. ``--moe-router-skew``: its Qwen3-MoE routers skewed as ours
(peer_vllm_skew.py, with router_skew.py, copied beside this file).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_common, beside this file
import peer_common  # noqa: E402


def _extra(fields: dict[str, Any]) -> dict[str, Any]:
    """A request's mix fields as vLLM's SamplingParams arguments."""
    if "json" not in fields:
        return dict(fields)
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(json=fields["json"])}


def llm_kwargs(args: argparse.Namespace, need_tokenizer: bool) -> dict[str, Any]:
    """vLLM's ``LLM`` arguments: the benchmark's settings. Pipeline stages run offline under the
    multiprocessing executor (``mp``)."""
    kwargs: dict[str, Any] = {
        "model": args.model, "load_format": args.load_format, "dtype": args.dtype, "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization, "seed": args.seed,
        "enforce_eager": args.enforce_eager, "enable_prefix_caching": args.enable_prefix_caching,
        "skip_tokenizer_init": not need_tokenizer,  # structured outputs need the tokenizer
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if args.pipeline_parallel_size > 1:
        kwargs["pipeline_parallel_size"] = args.pipeline_parallel_size
        kwargs["distributed_executor_backend"] = "mp"
    return kwargs


def main(argv: Sequence[str] | None = None) -> int:
    args = peer_common.common_arguments(argparse.ArgumentParser(description="vLLM's side of the benchmark"))\
        .parse_args(argv)
    import vllm
    from vllm import LLM, SamplingParams

    mix = peer_common.read_workload(args.workload).get("mix")
    result: dict[str, Any] = {"engine": "vllm", "version": vllm.__version__, "runs": [],
                              "python": sys.version.split()[0]}
    skew = None
    if args.moe_router_skew:  # before the model is built (peer_vllm_skew.py)
        import peer_vllm_skew

        skew = peer_vllm_skew.router_skew.parse_skew(args.moe_router_skew)
        peer_vllm_skew.install(skew)
    started = time.perf_counter()
    kwargs = llm_kwargs(args, need_tokenizer=mix is not None)
    result["arguments"] = kwargs
    llm = LLM(**kwargs)
    result["startup_s"] = time.perf_counter() - started
    if skew is not None:
        result["router_skew"] = peer_vllm_skew.fill_in_workers(llm, skew)
        print(f"vllm: skewed routers {result['router_skew']}", flush=True)
    print(f"vllm {vllm.__version__}: engine up after {result['startup_s']:.1f} s", flush=True)

    def generate(batch: Sequence[Sequence[int]], limits: Sequence[int],
                 extras: Sequence[dict[str, Any]] | None) -> tuple[int, float]:
        inputs: list[Any] = [{"prompt_token_ids": list(p)} for p in batch]
        params = [SamplingParams(temperature=peer_common.TEMPERATURE, ignore_eos=True, max_tokens=n,
                                 detokenize=False, seed=None, **_extra(fields))
                  for n, fields in zip(limits, extras or [{}] * len(limits), strict=True)]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(output.outputs[0].token_ids) for output in outputs), seconds

    peer_common.run_workload("vllm", generate, args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
