"""``benchmarks/throughput.py --peer sglang``: SGLang's offline ``Engine`` on the same workload, in a
process of its own (SGLang's packages live apart from this engine's, e.g. in /tmp/ssite: see
benchmarks/kits/sglang/).

This file runs as a script under SGLang's environment, with peer_common.py beside it, and imports
nothing of vllm_actors: ``python3 peer_sglang.py --model DIR --workload W.json --out R.json``, the
same arguments and measurements as peer_vllm.py (peer_common.run_workload). SGLang runs at its
defaults for the context length (``context_length`` = ``--max-model-len``), with its radix cache on
unless ``--no-enable-prefix-caching``; what is set, and why: ``sampling_backend="pytorch"``
(FlashInfer's sampling kernels would be compiled with nvcc on every fresh machine), the attention
backend named by ``--attention-backend`` (default fa3, which SGLang itself picks for dense models on
Hopper; recorded), ``load_format``/``dtype``/``random_seed``/``tp_size``/``pp_size`` as for the other engines.
The resolved server arguments go into the result (``server_args``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_common, beside this file
import peer_common  # noqa: E402

# The resolved server arguments worth a line in the report (what could not be made equal).
REPORTED_ARGS = ("attention_backend", "sampling_backend", "context_length", "chunked_prefill_size",
                 "max_prefill_tokens", "max_running_requests", "cuda_graph_max_bs", "mem_fraction_static",
                 "page_size", "schedule_policy", "disable_radix_cache", "disable_cuda_graph", "tp_size", "pp_size")


def sampling_params(max_tokens: int, fields: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling parameters for one request (a mix's ``json`` becomes ``json_schema``)."""
    params: dict[str, Any] = {"temperature": peer_common.TEMPERATURE, "max_new_tokens": max_tokens,
                              "ignore_eos": True}
    for key, value in fields.items():
        params["json_schema" if key == "json" else key] = value
    return params


def output_tokens(output: dict[str, Any]) -> int:
    """Tokens an output carries: ``meta_info.completion_tokens``, else the length of ``output_ids``."""
    meta = output.get("meta_info") or {}
    if meta.get("completion_tokens") is not None:
        return int(meta["completion_tokens"])
    return len(output.get("output_ids") or [])


def jsonable(values: dict[str, Any]) -> dict[str, Any]:
    """A dict of arguments as JSON can hold it (others as their ``str``)."""
    return {key: json.loads(json.dumps(value, default=str)) for key, value in values.items()
            if not key.startswith("_")}


def free_port() -> int:
    """A free TCP port for the engine's own sockets: two engines on one host must not share them."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def engine_kwargs(args: argparse.Namespace, need_tokenizer: bool) -> dict[str, Any]:
    kwargs = {"model_path": args.model, "load_format": args.load_format, "dtype": args.dtype,
              "context_length": args.max_model_len, "tp_size": args.tensor_parallel_size, "random_seed": args.seed,
              "skip_tokenizer_init": not need_tokenizer, "disable_radix_cache": not args.enable_prefix_caching,
              "disable_cuda_graph": args.enforce_eager, "attention_backend": args.attention_backend,
              "sampling_backend": "pytorch", "log_level": "error", "port": free_port()}
    if args.pipeline_parallel_size > 1:  # pipeline stages of tp_size GPUs each
        kwargs["pp_size"] = args.pipeline_parallel_size
    return kwargs


def main(argv: Sequence[str] | None = None) -> int:
    parser = peer_common.common_arguments(argparse.ArgumentParser(description="SGLang's side of the benchmark"))
    parser.add_argument("--attention-backend", default="fa3", help="SGLang's --attention-backend")
    args = parser.parse_args(argv)
    import sglang

    mix = peer_common.read_workload(args.workload).get("mix")
    result: dict[str, Any] = {"engine": "sglang", "version": sglang.__version__, "runs": [],
                              "python": sys.version.split()[0]}
    started = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(args, need_tokenizer=mix is not None))
    result["startup_s"] = time.perf_counter() - started
    resolved = jsonable(vars(engine.server_args))
    result["server_args"] = resolved
    result["settings"] = {key: resolved.get(key) for key in REPORTED_ARGS}
    print(f"sglang {sglang.__version__}: engine up after {result['startup_s']:.1f} s; {result['settings']}",
          flush=True)

    def generate(batch: Sequence[Sequence[int]], limits: Sequence[int],
                 extras: Sequence[dict[str, Any]] | None) -> tuple[int, float]:
        params = [sampling_params(n, fields) for n, fields in zip(limits, extras or [{}] * len(limits), strict=True)]
        start = time.perf_counter()
        outputs = engine.generate(input_ids=[list(p) for p in batch], sampling_params=params)
        seconds = time.perf_counter() - start
        listed = outputs if isinstance(outputs, list) else [outputs]
        return sum(output_tokens(output) for output in listed), seconds

    try:
        peer_common.run_workload("sglang", generate, args, result)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
