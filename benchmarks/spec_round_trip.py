"""The host's share of a speculating step's round trip, on the CPU: each actor's handling of each
message (the model's forward pass left out) and each message's encode + decode, per step, with and
without n-gram drafts, at batch 1, in the in-process engine with serialized messages.

With one step in flight a speculating request's GPU idles from the worker's read-back of step N
until step N+1's inputs are uploaded, while the result crosses worker -> scheduler, the scheduler
plans, and the plan crosses scheduler -> KV-cache manager -> worker; with two (n-gram drafts made
in the worker) the next plan was sent before the read-back: the share of steps where it was is
printed. This times the Python on that path (not the processes' wake-ups, which
``runtime/busy_poll.py`` covers); ``--help`` lists the options; the numbers depend on the machine.

``--batch N``: instead, N requests at once with the adaptive policy (as served) against a device
model where drafting does not pay at that batch size (``lib/spec_batch_host.py``): each actor's
host microseconds per step with and without n-gram speculation, the steps launched with the
pipeline drained and the plans with placeholders (the minimum over ``--repeats`` runs).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.support

from tests.support.fake_runner import FakeRunner

from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

PERIOD = 7  # the fake model repeats its context with this period: every n-gram draft is right


class PeriodicRunner(FakeRunner):
    def next_token(self, context: list[int]) -> int:
        return context[-PERIOD] if len(context) >= PERIOD else super().next_token(context)


def measure(num_spec: int, num_tokens: int) -> dict[str, Any]:
    """Microseconds per step of each hop's host work, and the messages per step."""
    runner = PeriodicRunner(num_blocks=256, block_size=16)
    spec = ({"method": "ngram", "num_speculative_tokens": num_spec, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
            if num_spec else None)
    config = EngineConfig(model="fake", block_size=16, max_num_batched_tokens=256, max_model_len=4096,
                          speculative_config=parse_speculative_config(spec, adaptive=False) if spec else None)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    model = [0.0]

    execute = runner.execute

    def timed_execute(batch: Any) -> Any:
        start = time.perf_counter()
        try:
            return execute(batch)
        finally:
            model[0] += time.perf_counter() - start

    runner.execute = timed_execute  # type: ignore[method-assign]  # the model's time is left out
    for loop in engine._loops:  # each actor's handling of each message type
        receive, name = loop.receive, loop.actor.name

        def timed_receive(sender: bytes, message: Any, receive: Any = receive, name: str = name) -> Any:
            before, start = model[0], time.perf_counter()
            try:
                return receive(sender, message)
            finally:
                key = f"{name} <- {type(message).__name__}"
                seconds[key] += time.perf_counter() - start - (model[0] - before)
                counts[key] += 1
                if name == "worker" and len(engine.scheduler.pipeline) > 1:  # planned before this read-back
                    counts["next plan sent"] += 1

        loop.receive = timed_receive  # type: ignore[method-assign]  # timing only
    network = engine._network
    post = network.post

    def timed_post(sender: bytes, destination: str, message: Any) -> None:
        start = time.perf_counter()
        post(sender, destination, message)
        key = f"wire {type(message).__name__} -> {destination}"
        seconds[key] += time.perf_counter() - start
        counts[key] += 1

    network.post = timed_post  # type: ignore[method-assign]  # timing only
    prompt = [(index * 13 + 5) % 90 + 1 for index in range(PERIOD)] * 3
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    engine.submit(engine.prepare("0", {"prompt_token_ids": prompt}, params))
    while engine.has_unfinished:
        engine.step()
    steps = counts["scheduler <- StepResult"]
    waiting = counts.pop("next plan sent", 0)
    return {"steps": steps, "tokens_per_step": num_tokens / steps, "next_plan_waiting": waiting / steps,
            "us_per_step": {key: 1e6 * value / steps for key, value in sorted(seconds.items())},
            "messages_per_step": {key: value / steps for key, value in sorted(counts.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=400, help="output tokens of the one request")
    parser.add_argument("--batch", type=int, default=0, help="N requests at once, the adaptive policy (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="with --batch: runs per mode (the minimum is shown)")
    args = parser.parse_args(argv)
    if args.batch:
        return batch_host(args.batch, args.num_speculative_tokens, args.tokens, args.repeats)
    for num_spec in (0, args.num_speculative_tokens):
        result = measure(num_spec, args.tokens)
        print(f"k={num_spec}: {result['steps']} steps, {result['tokens_per_step']:.2f} tokens/step, "
              f"the next plan sent before a step's read-back: {result['next_plan_waiting']:.0%}")
        for key, value in result["us_per_step"].items():
            print(f"  {key:45s} {value:8.1f} us/step  ({result['messages_per_step'][key]:.2f} per step)")
        total = sum(result["us_per_step"].values())
        print(f"  {'host total':45s} {total:8.1f} us/step, {total / result['tokens_per_step']:.1f} us/token")
    return 0


def batch_host(batch: int, num_spec: int, tokens: int, repeats: int) -> int:
    from benchmarks.lib.spec_batch_host import measure as measure_batch

    for k in (0, num_spec):
        runs = [measure_batch(batch, k, tokens) for _ in range(repeats)]
        keys = sorted({key for run in runs for key in run["us_per_step"]}, key=lambda key: key.strip())
        best = {key: min(run["us_per_step"].get(key, 0.0) for run in runs) for key in keys}
        last = runs[-1]
        print(f"k={k}, {batch} requests: {last['steps']} decode steps, {last['drained']} launched drained, "
              f"{last['plans_with_placeholders']} plans with placeholders ({last['placeholders']}), "
              f"{last['drafts']} request-steps drafted; device model {last['device_ms']:.1f} ms")
        for key, value in best.items():
            print(f"  {key:45s} {value:8.1f} us/step")
        total = sum(value for key, value in best.items() if not key.startswith(" "))
        print(f"  {'host total':45s} {total:8.1f} us/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
