"""How long a served model takes to recover from a killed worker, and what the kill costs a run.

``python benchmarks/recovery.py [--model DIR] [--kills 2]``: starts the offline ``LLM`` on a process
group (default: Qwen3-0.6B's shape with random weights, ``load_format="dummy"``), runs a batch of
token-id prompts once without a fault (the reference), then again ``--kills`` times with worker-0
SIGKILLed once the run has produced ``--kill-after`` tokens. Reports, per kill, the seconds from the
signal to the supervisor's restart (the new worker READY: weights loaded, KV pool allocated, CUDA
graphs captured), the run's wall time against the fault-free one, and whether every output is
complete and equal to the reference (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from vllm_actors.protocol.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/recovery.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a checkpoint; default: Qwen3-0.6B's shape, random weights")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=2000, help="generated tokens before the kill")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default=None, help="write the report as JSON")
    return parser


def _run(llm: Any, prompts: list[dict[str, list[int]]], params: SamplingParams,
         kill_after: int | None) -> dict[str, Any]:
    group = llm.group
    restarted = threading.Event()
    record: dict[str, Any] = {}

    def on_restart(actor: str) -> None:
        if actor == "worker-0" and "killed" in record and "restart_seconds" not in record:
            record["restart_seconds"] = time.monotonic() - record["killed"]
            restarted.set()

    group.on_restart(on_restart)

    def killer() -> None:
        baseline = llm.get_metrics().generation_tokens
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if llm.get_metrics().generation_tokens - baseline >= (kill_after or 0):
                pid = group.pids()["worker-0"]
                record["killed"] = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=killer, daemon=True) if kill_after is not None else None
    started = time.monotonic()
    if thread is not None:
        thread.start()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    record["wall_seconds"] = time.monotonic() - started
    if thread is not None:
        thread.join(timeout=10)
        restarted.wait(timeout=600)
    record["outputs"] = [list(output.outputs[0].token_ids) for output in outputs]
    record["complete"] = all(output.outputs[0].finish_reason == "length" for output in outputs)
    return record


def main(argv: list[str] | None = None) -> int:
    from vllm_actors import LLM
    from vllm_actors.bench.throughput_workload import write_model_dir

    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or str(write_model_dir(Path(folder) / "qwen3-0.6b"))
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        engine: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
                                  "skip_tokenizer_init": True, "enable_prefix_caching": False}
        if args.model is None:
            engine["load_format"] = "dummy"
        started = time.monotonic()
        with LLM(model, **engine) as llm:
            start_seconds = time.monotonic() - started
            rng = random.Random(0)
            high = min(llm.vocab_size, 30000)
            prompts = [{"prompt_token_ids": [rng.randrange(high // 30, high) for _ in range(args.input_len)]}
                       for _ in range(args.num_requests)]
            _run(llm, prompts[:4], params, None)  # warm-up
            reference = _run(llm, prompts, params, None)
            runs = [_run(llm, prompts, params, args.kill_after) for _ in range(args.kills)]
    report = {
        "engine_start_seconds": round(start_seconds, 2),
        "fault_free_wall_seconds": round(reference["wall_seconds"], 3),
        "kills": [
            {
                "restart_seconds": round(run.get("restart_seconds", float("nan")), 3),
                "wall_seconds": round(run["wall_seconds"], 3),
                "extra_seconds": round(run["wall_seconds"] - reference["wall_seconds"], 3),
                "complete": run["complete"],
                "identical_outputs": sum(a == b for a, b in zip(run["outputs"], reference["outputs"], strict=True)),
            }
            for run in runs
        ],
        "num_requests": args.num_requests,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(kill["complete"] for kill in report["kills"]) else 1
