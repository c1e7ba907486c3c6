"""A speculating engine's plain steps on the CPU: the in-process engine (messages serialized) on a tiny
random Qwen3 (tests' builder), ``--requests`` concurrent requests of random non-repeating prompt
tokens, greedy, ``--tokens`` output tokens each, with and without n-gram speculation (k=4, lookup
2..4), alternating for ``--rounds`` rounds. The model is tiny, so the host's work per step is much
of the time: the difference is what speculation costs on steps that draft (almost) nothing.

Prints per round and engine the wall and CPU milliseconds per output token, the CPU milliseconds per
step outside the model's forward passes (in all, and per actor: the scheduler's, the KV-cache
manager's and the worker's handling with their messages' delivery and sending; the frontend and
the loop the rest), the steps, those launched only after the step before was read back (on a GPU
the device idles meanwhile; on this CPU nothing overlaps anyway) and the drafted tokens; then the
medians, and the median CPU time of the worker's handling of a plan and of the scheduler's of a step
result (with the next plan it makes), each for plans with and without drafts (``WORKER_DRAFT``
placeholders): the adaptive policy drafts more in some runs than in others, so the totals mix the
two kinds in varying parts. CPU times are the engine thread's (torch runs one thread here), so other
load on the machine disturbs them less than the wall times. Checks that both engines' outputs are
token-identical. ``--profile DIR`` writes one
cProfile of each engine's last round (``pstats`` files) and prints the top functions by own time.

    python benchmarks/spec_plain_cpu.py --rounds 5
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

from tests.support.tiny_models import build_checkpoint  # noqa: E402

from vllm_actors.clients.inprocess import InProcessEngine  # noqa: E402
from vllm_actors.engine_args import make_engine_config  # noqa: E402
from vllm_actors.protocol.events import StepFinished  # noqa: E402
from vllm_actors.protocol.messages import StepPlan, StepResult  # noqa: E402
from vllm_actors.protocol.outputs import Outputs  # noqa: E402
from vllm_actors.protocol.sampling import SamplingParams  # noqa: E402

VOCAB = 500  # prompt tokens from 3 up to this (the tiny tokenizer has 512)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts, no token twice in one prompt (so no n-gram of the prompt repeats)."""
    rng = random.Random(seed)
    return [rng.sample(range(3, vocab), length) for _ in range(count)]


class Engine:
    """The in-process engine (messages serialized, as between processes), its model's forward
    passes timed (to leave them out) and each engine actor's handling timed (delivery, handling,
    sending)."""

    def __init__(self, model: Path, spec: dict[str, Any] | None, requests: int) -> None:
        config = make_engine_config(str(model), {"device": "cpu", "max_num_seqs": requests, "max_model_len": 512,
                                                 "speculative_config": spec})
        self.engine = InProcessEngine(config, serialize=True)
        self.steps: list[StepFinished] = []
        self.engine.event_listeners.append(
            lambda batch: self.steps.extend(e for e in batch.events if isinstance(e, StepFinished)))
        self.forward_seconds = 0.0
        self.actor_seconds: dict[str, float] = defaultdict(float)
        self._ids = itertools.count()
        network = self.engine.worker.runner.model  # type: ignore[attr-defined]  # the model runner's
        network.forward = self._timed(network.forward, "forward")
        self.drained = 0  # steps launched after the step before was read back (not overlapped with it)
        worker = self.engine.worker
        launch = worker._launch

        def counted(plan: Any, started: Any, read_now: bool, *args: Any, **kwargs: Any) -> Any:
            self.drained += read_now and plan.req_ids != []
            return launch(plan, started, read_now, *args, **kwargs)

        worker._launch = counted  # type: ignore[method-assign]
        # CPU seconds of each handling, by kind: the worker's of a plan, the scheduler's of a step
        # result (with the next plan it makes), each as "plain" or "placeholders" (the plan's drafts)
        self.handlings: dict[str, list[float]] = defaultdict(list)
        for actor in (self.engine.scheduler, worker):
            actor.handle = self._classified(actor.handle, actor.name)  # type: ignore[method-assign]
        for loop in self.engine._loops:
            loop.receive = self._timed(loop.receive, loop.actor.name)  # type: ignore[method-assign]
            loop.flush = self._timed(loop.flush, loop.actor.name)  # type: ignore[method-assign]

    def _timed(self, function: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                if name == "forward":
                    self.forward_seconds += time.thread_time() - start
                else:
                    self.actor_seconds[name] += time.thread_time() - start

        return timed

    def _classified(self, handle: Callable[[Any], Outputs], name: str) -> Callable[[Any], Outputs]:
        def timed(message: Any) -> Outputs:
            forward, start = self.forward_seconds, time.thread_time()
            outputs = handle(message)
            seconds = time.thread_time() - start - (self.forward_seconds - forward)
            plans = [message] if isinstance(message, StepPlan) and name == "worker" else \
                [m for _, m in outputs.messages if isinstance(m, StepPlan)] if isinstance(message, StepResult) else []
            if plans:
                self.handlings[f"{name} {'placeholders' if plans[0].draft_token_ids else 'plain'}"].append(seconds)
            return outputs

        return timed

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        ids = [str(next(self._ids)) for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.engine.submit(self.engine.prepare(request_id, {"prompt_token_ids": prompt}, params))
        finished: dict[str, list[int]] = {}
        while self.engine.has_unfinished:
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
        return [finished[request_id] for request_id in ids]


class Round(NamedTuple):
    wall_per_token: float  # seconds
    cpu_per_token: float  # the engine thread's CPU seconds (less sensitive to other load on the machine)
    host_per_step: float  # CPU seconds per step outside the model's forward passes
    per_actor: dict[str, float]  # CPU seconds per step: scheduler, KV manager, worker less forward, the rest
    drafted: int
    steps: int
    drained: int
    handlings: dict[str, list[float]]  # CPU seconds per handling, by kind (Engine.handlings)
    outputs: list[list[int]]


def one_round(engine: Engine, batch: list[list[int]], tokens: int, profile: cProfile.Profile | None) -> Round:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.steps.clear()
    engine.forward_seconds = 0.0
    engine.actor_seconds.clear()
    engine.drained = 0
    engine.handlings.clear()
    start, cpu = time.perf_counter(), time.thread_time()
    if profile is not None:
        profile.enable()
    ids = engine.generate(batch, params)
    if profile is not None:
        profile.disable()
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    num_tokens, num_steps = sum(len(i) for i in ids), max(len(engine.steps), 1)
    actors = dict(engine.actor_seconds)
    actors["worker"] -= engine.forward_seconds
    actors["frontend+loop"] = cpu - engine.forward_seconds - sum(actors.values())
    return Round(elapsed / num_tokens, cpu / num_tokens, (cpu - engine.forward_seconds) / num_steps,
                 {name: seconds / num_steps for name, seconds in actors.items()},
                 sum(s.num_draft_tokens for s in engine.steps), len(engine.steps), engine.drained,
                 {kind: list(seconds) for kind, seconds in engine.handlings.items()}, ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", type=Path, default=None, help="write cProfile stats of the last round here")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp) / "tiny_qwen3", "qwen3", tie_word_embeddings=True)
        engines = {"plain": Engine(model, None, args.requests), "ngram": Engine(model, NGRAM, args.requests)}
        warm = prompts(args.requests, args.prompt_len, VOCAB, seed=10_000)
        for engine in engines.values():
            one_round(engine, warm, 8, None)
        rounds: dict[str, list[Round]] = {name: [] for name in engines}
        for index in range(args.rounds):
            batch = prompts(args.requests, args.prompt_len, VOCAB, seed=index)
            for name, engine in engines.items():
                last = index == args.rounds - 1 and args.profile is not None
                profile = cProfile.Profile() if last else None
                result = one_round(engine, batch, args.tokens, profile)
                rounds[name].append(result)
                actors = ", ".join(f"{actor} {seconds * 1e3:.2f}" for actor, seconds in result.per_actor.items())
                print(f"round {index} {name:5s}: {result.wall_per_token * 1e3:.3f} ms/token wall, "
                      f"{result.cpu_per_token * 1e3:.3f} CPU; CPU {result.host_per_step * 1e3:.2f} ms/step "
                      f"outside the forward passes ({actors}); {result.steps} steps ({result.drained} launched "
                      f"after the one before was read back), {result.drafted} drafted tokens",
                      flush=True)
                if profile is not None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    profile.dump_stats(str(args.profile / f"{name}.pstats"))
            if rounds["plain"][-1].outputs != rounds["ngram"][-1].outputs:
                raise AssertionError(f"round {index}: the outputs differ with speculation")

        def median(name: str, field: str) -> float:
            return statistics.median(getattr(r, field) for r in rounds[name])

        print(f"medians over {args.rounds} rounds (plain / ngram, ngram/plain):")
        for field, label, scale in (("wall_per_token", "wall ms/token", 1e3), ("cpu_per_token", "CPU ms/token", 1e3),
                                    ("host_per_step", "CPU ms/step outside the forward passes", 1e3),
                                    ("drafted", "drafted tokens", 1), ("drained", "steps not overlapped", 1)):
            plain, ngram = median("plain", field), median("ngram", field)
            ratio = f"{ngram / plain:.3f}" if plain else "-"
            print(f"  {label}: {plain * scale:.3f} / {ngram * scale:.3f}, {ratio}")
        print("  CPU ms per handling, all rounds' medians (count):")
        for name in engines:
            kinds: dict[str, list[float]] = defaultdict(list)
            for result in rounds[name]:
                for kind, seconds in result.handlings.items():
                    kinds[kind].extend(seconds)
            print(f"    {name}: " + ", ".join(f"{kind} {statistics.median(seconds) * 1e3:.3f} ({len(seconds)})"
                                          for kind, seconds in sorted(kinds.items())))
        for actor in rounds["plain"][0].per_actor:
            plain, ngram = (statistics.median(r.per_actor[actor] for r in rounds[name]) for name in ("plain", "ngram"))
            print(f"  {actor} CPU ms/step: {plain * 1e3:.3f} / {ngram * 1e3:.3f}, {ngram / plain:.3f}")
        if args.profile is not None:
            for name in engines:
                print(f"--- {name}: top {args.top} by own time")
                pstats.Stats(str(args.profile / f"{name}.pstats")).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
