"""How long a served model takes to recover from a killed worker under load, and what the kill costs.

``python benchmarks/recovery.py [--model DIR | --model-shape qwen3-8b] [--tensor-parallel-size 2]
[--pipeline-parallel-size 2] [--kill-role stage] [--kill-index 1] [--kills 1]``: starts the offline
``LLM`` on a process group (default: Qwen3-0.6B's shape with random weights, ``load_format="dummy"``),
runs a batch of token-id prompts once without a fault (the reference), then again ``--kills`` times
with one worker SIGKILLed once the run has produced ``--kill-after`` tokens: ``--kill-role rank``
(the default) kills tensor-parallel rank ``--kill-index`` of the first stage, ``--kill-role stage``
the process of pipeline stage ``--kill-index`` (its first rank). The supervisor takes the replica's
other ranks and stages down with it and starts them all again.

Reports, per kill, in seconds from the signal: ``respawn_seconds`` (the failure noticed, the old
unit killed, the victim's new process started), ``ready_seconds`` per restarted worker and
``all_back_seconds`` (every one READY again: weights loaded, KV pool allocated, CUDA graphs
captured; the supervisor's restarts), ``serving_again_seconds`` (the first token generated again
reaching the client); then ``requests_lost`` (not finished with all ``--output-len`` tokens: must be
0), ``identical_outputs`` (equal to the fault-free run's; greedy), ``old_processes_alive`` (workers
of the killed unit still running 10 s after the restart: a surviving peer stuck in a collective)
and ``hung`` (a run not finished within ``--timeout`` seconds: its requests are aborted and the
benchmark fails with the group's state rather than wait). Exit status 1 when a request was lost,
a run hung or a process was left.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib.recovery_run import KILL_ROLES, Kill, Restarts, kill_report, timed_run, victim_actor
from vllm_actors.bench.throughput_workload import MODEL_SHAPES
from vllm_actors.protocol.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/recovery.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint; default: --model-shape, random weights")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=2000, help="generated tokens before the kill")
    parser.add_argument("--kill-role", choices=KILL_ROLES, default="rank",
                        help="rank: a tensor-parallel rank of the first stage; stage: a pipeline stage's process")
    parser.add_argument("--kill-index", type=int, default=0, help="which rank or stage (0-based)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one run may take before it counts as hung (its requests aborted)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default=None, help="write the report as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    from vllm_actors import LLM
    from vllm_actors.bench.throughput_workload import write_model_dir

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        victim = victim_actor(args.kill_role, args.kill_index, args.tensor_parallel_size,
                              args.pipeline_parallel_size)
    except ValueError as error:
        parser.error(str(error))
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or str(write_model_dir(Path(folder) / args.model_shape, MODEL_SHAPES[args.model_shape]))
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        engine: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
                                  "skip_tokenizer_init": True, "enable_prefix_caching": False,
                                  "tensor_parallel_size": args.tensor_parallel_size,
                                  "pipeline_parallel_size": args.pipeline_parallel_size}
        if args.model is None:
            engine["load_format"] = "dummy"
        started = time.monotonic()
        with LLM(model, **engine) as llm:
            start_seconds = time.monotonic() - started
            restarts = Restarts()
            llm.group.on_restart(restarts)
            rng = random.Random(0)
            high = min(llm.vocab_size, 30000)
            prompts = [{"prompt_token_ids": [rng.randrange(high // 30, high) for _ in range(args.input_len)]}
                       for _ in range(args.num_requests)]
            timed_run(llm, prompts[:4], params, None, args.timeout, "warm-up")
            reference = timed_run(llm, prompts, params, None, args.timeout, "reference")
            kills = []
            for index in range(args.kills):
                kill = Kill(victim, args.kill_after)
                run = timed_run(llm, prompts, params, kill, args.timeout, f"kill-{index}")
                kills.append(kill_report(run, kill, restarts, reference, args.output_len))
                if run["hung"]:
                    kills[-1]["group_state"] = llm.group.state()
                    break
    report = {
        "engine_start_seconds": round(start_seconds, 2),
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "fault_free_wall_seconds": round(reference["wall_seconds"], 3),
        "fault_free_hung": reference["hung"],
        "kills": kills,
        "num_requests": args.num_requests,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    failures = [f"kill {index}: {failure}" for index, kill in enumerate(kills) for failure in _failures(kill)]
    if reference["hung"]:
        failures.insert(0, f"the fault-free run did not finish within --timeout {args.timeout} s")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


def _failures(kill: dict[str, Any]) -> list[str]:
    """What went wrong in one kill's report, in words."""
    if not kill["killed"]:
        return [kill["error"]]
    failures = []
    if kill["hung"]:
        failures.append(f"the run did not finish within --timeout (group state: {kill.get('group_state')})")
    if kill["requests_lost"]:
        failures.append(f"{kill['requests_lost']} requests lost (not finished with every token)")
    if kill["old_processes_alive"]:
        failures.append(f"processes of the killed unit still alive: {kill['old_processes_alive']}")
    if kill["serving_again_seconds"] is None:
        failures.append("no token was generated after the restart")
    return failures
