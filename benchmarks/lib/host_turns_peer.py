"""``benchmarks/host_turns.py``'s measurement, and its vLLM side: one engine in one mode, in a process
of its own, the cycles of a long conversation whose prefix leaves the GPU between two turns.

This file runs as a script under vLLM's environment (its packages apart, e.g. /tmp/vsite) and
imports nothing of vllm_actors: ``python3 host_turns_peer.py --engine vllm --mode host --plan P.json
--model DIR --out R.json``. Our engine runs the same ``run_cycles`` loop (host_turns_ours.py), so
both are measured alike, by the client's clock, one request at a time, greedy, EOS ignored:

* the engine starts (timed) with ``max_model_len`` = the plan's context, a GPU pool of the plan's
  ``pool_blocks`` blocks, and in mode ``host`` host memory for the evicted blocks (mode
  ``recompute``: none); then ``WARMUP_REQUESTS`` short requests;
* per cycle (``--warmup-cycles`` discarded ones first, then ``--repeats``), fresh random prompts,
  the same for every engine and mode: turn 1 (its TTFT and end-to-end time, its output kept), the
  fillers one after the other, then turn 2 = turn 1's prompt + its output + new tokens, for one
  token: its TTFT is the figure, its token the check (greedy: the same whether the prefix came
  back from host memory or was recomputed);
* the engine's counters are read before and after each phase (turn 1, fillers, turn 2), off the
  clock, and each phase keeps their differences. Every engine's counters carry the same four
  tokens figures: ``computed_tokens`` (prompt tokens computed), ``cached_tokens`` (not computed),
  of them ``restored_tokens`` (brought back from host memory) and ``gpu_hit_tokens`` (found in the
  GPU pool), beside the engine's own counters.

vLLM 0.26's CPU KV offloading is its engine argument ``kv_offloading_size`` (GiB; CacheConfig: "Size
of the KV cache offloading buffer in GiB ... When set, vLLM will enable KV cache offloading to CPU
using the kv_offloading_backend") with ``kv_offloading_backend="native"``, its default, spelled out:
VllmConfig._post_init_kv_transfer_config turns the pair into ``kv_transfer_config`` =
OffloadingConnector, ``kv_role`` "kv_both", ``cpu_bytes_to_use`` = size x 2^30; the documented
spelling, rather than that connector config by hand, which is its expansion. Its counters come from
``LLM.get_metrics()`` (stats logging on): ``vllm:prompt_tokens_by_source`` by source
(``local_compute``, ``local_cache_hit``, ``external_kv_transfer``: the connector's loads),
``vllm:prompt_tokens_cached``, the prefix cache's queries and hits and the offloading's
``vllm:kv_offload_*`` bytes. Its CPU buffer is a file in /dev/shm (SharedOffloadRegion), pinned
with cudaHostRegister: the settings keep /dev/shm's free space before the start. An engine that
fails to start records the error in the result (the benchmark then runs the next mode).

The result JSON is rewritten after every cycle, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

MODES = ("host", "recompute")  # host memory for evicted KV blocks on / off
TOKEN_RANGE = 10000  # prompt token ids are drawn below this (then folded into the vocabulary)
WARMUP_REQUESTS = 2
WARMUP_PROMPT = 256
WARMUP_OUTPUT = 8
TOKEN_KEYS = ("computed_tokens", "cached_tokens", "restored_tokens", "gpu_hit_tokens")


class Streamed(NamedTuple):
    ttft_s: float  # from the call to the first token
    e2e_s: float  # from the call to the last
    token_ids: list[int]


class TurnsEngine(Protocol):
    name: str

    def start(self) -> dict[str, Any]:
        """Start the engine; its resolved settings."""

    def stream(self, prompt: list[int], max_tokens: int) -> Streamed:
        """One request alone, greedy, EOS ignored, timed by the client's clock."""

    def counters(self) -> dict[str, float]:
        """Cumulative counters, ``TOKEN_KEYS`` among them, once every request sent has been counted."""

    def shutdown(self) -> None: ...


# --------------------------------------------------------------------------- prompts and counters
def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(TOKEN_RANGE) % vocab_size for _ in range(length)]


def cycle_prompts(seed: int, cycle: int, plan: Mapping[str, Any],
                  vocab_size: int) -> tuple[list[int], list[list[int]], list[int]]:
    """Turn 1's prompt, the fillers' and turn 2's new tokens of one cycle (negative: a warm-up one).
    String seeds: an integer seed's sign is dropped (Random(-1) is Random(1))."""
    rng = random.Random(f"host-turns:{seed}:cycle:{cycle}")
    turn1 = random_prompt(rng, plan["turn1_prompt"], vocab_size)
    fillers = [random_prompt(rng, length, vocab_size) for length in plan["filler_lens"]]
    return turn1, fillers, random_prompt(rng, plan["new_tokens"], vocab_size)


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each counter read at both ends counted in between."""
    return {key: after[key] - before[key] for key in after if key in before}


def vllm_counters(metrics: Sequence[Any]) -> dict[str, float]:
    """vLLM's counters summed over its engines, keyed ``name`` or ``name{label=value}`` (labels other
    than the engine's and the model's), and the four ``TOKEN_KEYS``."""
    totals: dict[str, float] = {}
    for metric in metrics:
        if type(metric).__name__ != "Counter":
            continue
        labels = {k: v for k, v in (getattr(metric, "labels", None) or {}).items() if k not in ("engine", "model_name")}
        key = metric.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
        totals[key] = totals.get(key, 0.0) + float(metric.value)
    source = "vllm:prompt_tokens_by_source{source=%s}"
    totals.update(computed_tokens=totals.get(source % "local_compute", 0.0),
                  restored_tokens=totals.get(source % "external_kv_transfer", 0.0),
                  gpu_hit_tokens=totals.get(source % "local_cache_hit", 0.0))
    totals["cached_tokens"] = totals["restored_tokens"] + totals["gpu_hit_tokens"]
    return totals


# --------------------------------------------------------------------------- a cycle
def run_cycle(engine: TurnsEngine, plan: Mapping[str, Any], seed: int, cycle: int,
              vocab_size: int) -> dict[str, Any]:
    """Turn 1, the fillers, turn 2; each phase's figures and counters."""
    turn1, fillers, new = cycle_prompts(seed, cycle, plan, vocab_size)
    read = [engine.counters()]
    first = engine.stream(turn1, plan["turn_output"])
    if len(first.token_ids) != plan["turn_output"]:
        raise RuntimeError(f"turn 1 gave {len(first.token_ids)} tokens, not {plan['turn_output']}")
    read.append(engine.counters())
    started = time.perf_counter()
    for filler in fillers:
        engine.stream(filler, 1)
    filled_s = time.perf_counter() - started
    read.append(engine.counters())
    prompt2 = turn1 + list(first.token_ids) + new
    second = engine.stream(prompt2, 1)
    read.append(engine.counters())
    return {
        "cycle": cycle,
        "turn1": {"prompt_len": len(turn1), "ttft_s": first.ttft_s, "e2e_s": first.e2e_s,
                  "tokens": len(first.token_ids)},
        "fillers": {"count": len(fillers), "tokens": sum(map(len, fillers)), "seconds": filled_s},
        "turn2": {"prompt_len": len(prompt2), "ttft_s": second.ttft_s, "token": second.token_ids[0]},
        "counters": {phase: counter_delta(read[i], read[i + 1]) for i, phase in
                     enumerate(("turn1", "fillers", "turn2"))},
    }


def summarize(cycles: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The medians over the measured cycles, turn 2's samples, and its tokens by source."""
    turn2 = [c["turn2"]["ttft_s"] * 1e3 for c in cycles]
    summary: dict[str, Any] = {
        "repeats": len(cycles),
        "turn1_ttft_ms": statistics.median(c["turn1"]["ttft_s"] * 1e3 for c in cycles),
        "turn1_e2e_ms": statistics.median(c["turn1"]["e2e_s"] * 1e3 for c in cycles),
        "turn2_ttft_ms": statistics.median(turn2), "turn2_ttft_ms_samples": turn2,
        "turn2_prompt_len": cycles[0]["turn2"]["prompt_len"],
        "turn2_tokens": [c["turn2"]["token"] for c in cycles],
    }
    for key in TOKEN_KEYS:
        values = [c["counters"]["turn2"].get(key) for c in cycles]
        summary[f"turn2_{key}"] = statistics.median(values) if None not in values else None
    return summary


# --------------------------------------------------------------------------- the run
def _write(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1, default=str)


def warm_up(engine: TurnsEngine, seed: int, vocab_size: int) -> float:
    rng = random.Random(f"host-turns:{seed}:warm-up")
    started = time.perf_counter()
    for _ in range(WARMUP_REQUESTS):
        engine.stream(random_prompt(rng, WARMUP_PROMPT, vocab_size), WARMUP_OUTPUT)
    return time.perf_counter() - started


def run_cycles(engine: TurnsEngine, args: argparse.Namespace, plan: Mapping[str, Any]) -> int:
    """Start, warm up, the cycles, shut down; the JSON at ``args.out`` after each part."""
    result: dict[str, Any] = {"engine": engine.name, "mode": args.mode, "python": sys.version.split()[0],
                              "args": vars(args), "plan": dict(plan), "cycles": [], "warmup_cycles": []}
    started = time.perf_counter()
    try:
        result["settings"] = engine.start()
    except Exception as error:
        result["error"] = f"startup: {type(error).__name__}: {error}"
        _write(args.out, result)
        raise
    result["startup_s"] = time.perf_counter() - started
    print(f"{engine.name} {args.mode}: engine up after {result['startup_s']:.1f} s", flush=True)
    _write(args.out, result)
    try:
        result["warmup_s"] = warm_up(engine, args.seed, args.vocab_size)
        for index in range(args.warmup_cycles + args.repeats):
            warm = index < args.warmup_cycles
            cycle = run_cycle(engine, plan, args.seed, index - args.warmup_cycles, args.vocab_size)
            result["warmup_cycles" if warm else "cycles"].append(cycle)
            counted = cycle["counters"]["turn2"]
            print(f"{engine.name} {args.mode} cycle {cycle['cycle']}: turn 1 TTFT "
                  f"{cycle['turn1']['ttft_s'] * 1e3:,.1f} ms, turn 2 TTFT {cycle['turn2']['ttft_s'] * 1e3:,.1f} ms "
                  f"({counted.get('restored_tokens', 0):,.0f} tokens restored, "
                  f"{counted.get('computed_tokens', 0):,.0f} computed)", flush=True)
            if not warm:
                result["summary"] = summarize(result["cycles"])
            _write(args.out, result)
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        _write(args.out, result)
        raise
    finally:
        engine.shutdown()
    _write(args.out, result)
    return 0


# --------------------------------------------------------------------------- vLLM
class VllmTurns:
    name = "vllm"

    def __init__(self, args: argparse.Namespace, plan: Mapping[str, Any]) -> None:
        self.args = args
        self.plan = plan
        self.llm: Any = None
        self.ids = 0

    def arguments(self) -> dict[str, Any]:
        a, plan = self.args, self.plan
        kwargs: dict[str, Any] = {
            "model": a.model, "load_format": a.load_format, "dtype": a.dtype, "max_model_len": plan["context"],
            "enable_prefix_caching": True, "tensor_parallel_size": a.tensor_parallel_size,
            "gpu_memory_utilization": a.gpu_memory_utilization, "skip_tokenizer_init": True, "seed": a.seed,
            "block_size": plan["block_size"], "num_gpu_blocks_override": plan["pool_blocks"],
            "disable_log_stats": False,  # get_metrics() reads the stats loggers' counters
        }
        if a.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = a.max_num_batched_tokens
        if a.mode == "host":
            kwargs.update(kv_offloading_size=plan["host_gib"], kv_offloading_backend="native")
        return kwargs

    def start(self) -> dict[str, Any]:
        import vllm
        from vllm import LLM

        kwargs = self.arguments()
        settings: dict[str, Any] = {"version": vllm.__version__, "arguments": kwargs}
        if self.args.mode == "host":  # its CPU buffer is a file in /dev/shm: a smaller tmpfs fails it (SIGBUS)
            try:
                settings["dev_shm_free_gib"] = shutil.disk_usage("/dev/shm").free / 2**30
            except OSError as error:
                settings["dev_shm_free_gib"] = f"{type(error).__name__}: {error}"
        self.llm = LLM(**kwargs)
        try:  # what vLLM resolved (attribute names move between versions)
            config = self.llm.llm_engine.vllm_config
            settings["num_gpu_blocks"] = config.cache_config.num_gpu_blocks
            settings["block_size"] = config.cache_config.block_size
            settings["max_num_batched_tokens"] = config.scheduler_config.max_num_batched_tokens
            settings["kv_transfer_config"] = str(config.kv_transfer_config)
        except Exception as error:
            settings["resolved_error"] = f"{type(error).__name__}: {error}"
        return settings

    def stream(self, prompt: list[int], max_tokens: int) -> Streamed:
        from vllm import SamplingParams

        try:  # an update every step (LLM.generate may ask for the final output only)
            from vllm.sampling_params import RequestOutputKind

            kind: dict[str, Any] = {"output_kind": RequestOutputKind.CUMULATIVE}
        except ImportError:
            kind = {}
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False, **kind)
        engine = self.llm.llm_engine
        self.ids += 1
        request_id = f"turns-{self.ids}"
        first: float | None = None
        tokens: list[int] = []
        start = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.outputs[0].token_ids:
                    tokens = list(output.outputs[0].token_ids)
                    first = first if first is not None else time.perf_counter() - start
        if first is None:
            raise RuntimeError("the request produced no token")
        return Streamed(first, time.perf_counter() - start, tokens)

    def counters(self) -> dict[str, float]:
        return vllm_counters(self.llm.get_metrics())  # updated as each step's outputs are processed

    def shutdown(self) -> None:
        self.llm = None  # vLLM's LLM has no shutdown; the process ends next


# --------------------------------------------------------------------------- arguments
def build_parser(engines: Sequence[str] = ("vllm",)) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one engine's side of the host KV tier benchmark")
    parser.add_argument("--engine", required=True, choices=tuple(engines))
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--plan", required=True, help="the plan's JSON file (host_turns_plan.TurnsPlan.to_dict)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup-cycles", type=int, default=0)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, required=True)
    return parser


def parse_args(argv: Sequence[str] | None = None,
               engines: Sequence[str] = ("vllm",)) -> tuple[argparse.Namespace, dict[str, Any]]:
    parser = build_parser(engines)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup_cycles < 0:
        parser.error("--repeats must be at least 1 and --warmup-cycles at least 0")
    with open(args.plan) as handle:
        plan = dict(json.load(handle))
    return args, plan


def main(argv: Sequence[str] | None = None) -> int:
    args, plan = parse_args(argv)
    return run_cycles(VllmTurns(args, plan), args, plan)


if __name__ == "__main__":
    raise SystemExit(main())
