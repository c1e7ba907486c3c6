"""The worker's host work per step on the CPU, phase by phase, with and without n-gram drafts, at
batch 1: the real model runner on the embedded SmolLM2-135M (or ``--model``), its decode graphs
stood in for by an eager pass over their static inputs (so the graphs' input path runs as on a GPU:
the verification rows, the packed upload, the deferred inputs), whose time is left out, as is every
other forward pass. In process, messages serialized.

A drafting step is read back at once, so on a GPU everything the worker does from the read-back
of step N to the replay of step N+1 runs while the device idles; a plain step is launched before
the previous one is read back. The phases are inclusive (a phase's time holds the phases it
calls); ``--profile`` adds cProfile's top functions. ``--help`` lists the options; the numbers
depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import os
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository

os.environ.setdefault("VLLM_ACTORS_SAMPLER", "triton")  # graph_params as on a GPU (greedy rows: argmax)

import torch  # noqa: E402
from tests.support.stand_in_graphs import EagerReplay  # noqa: E402

from vllm_actors.actors.worker import batch as batch_module  # noqa: E402
from vllm_actors.actors.worker import ngram_drafts, worker  # noqa: E402
from vllm_actors.clients.inprocess import InProcessEngine  # noqa: E402
from vllm_actors.default_model import default_model_path  # noqa: E402
from vllm_actors.protocol.config import EngineConfig  # noqa: E402
from vllm_actors.protocol.sampling import SamplingParams  # noqa: E402
from vllm_actors.protocol.speculative import parse_speculative_config  # noqa: E402
from vllm_actors.runner import graph_draws, model_runner, sampler  # noqa: E402
from vllm_actors.runner.graph_inputs import DecodeGraph, GraphInputs  # noqa: E402
from vllm_actors.runner.model_runner import ModelRunner  # noqa: E402
from vllm_actors.runner.verify_rows import decode_graph_rows, queries_per_read  # noqa: E402

REPEATING = ("Copy the list exactly.\nList: red, green, blue, yellow, orange, purple, black, white, grey, "
             "brown, pink, gold, silver, navy, teal, olive, maroon, lime, cyan, magenta.\nCopy: red, green,")


FAKE_LOGITS = False  # --fake-logits: no forward pass in the decode graphs' stand-ins (warm host caches)


def periodic(positions: Any) -> Any:
    return 3 + (positions % 7) * 5


class Spans:
    """Inclusive seconds per phase per step; the forward passes' time is left out of every span."""

    def __init__(self) -> None:
        self.restore: list[tuple[Any, str, Any]] = []
        self.model = 0.0
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[bool, dict[str, float]]] = []
        self.drafting = False

    def wrap(self, owner: Any, name: str, label: str, model: bool = False) -> None:
        original = getattr(owner, name)
        self.restore.append((owner, name, inspect.getattr_static(owner, name)))
        spans = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            before, start = spans.model, time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                if model:
                    spans.model += elapsed
                else:
                    spans.current[label] += elapsed - (spans.model - before)

        static = isinstance(inspect.getattr_static(owner, name), staticmethod)
        setattr(owner, name, staticmethod(timed) if static else timed)

    def end_step(self) -> None:
        if self.current:
            self.steps.append((self.drafting, dict(self.current)))
        self.current = defaultdict(float)
        self.drafting = False


class StandInGraphs(ModelRunner):
    """The model runner with its decode graphs (plain and sampling) stood in for on the CPU."""

    def capture_graphs(self) -> None:
        largest = decode_graph_rows(self.max_num_seqs, self.max_num_tokens, self.config.speculative_config)
        sizes = list(range(1, largest + 1))  # a graph per size: no padded rows (the CPU attention takes no slot -1)
        self._weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        reads = queries_per_read(bool(self.config.speculative_config), self.model, self.local_config)
        self._static = GraphInputs(largest, self.max_blocks_per_seq, self.block_size, self.device,
                                   queries_per_read=reads)
        for size in sizes:
            inputs = self._static.for_bucket(size)
            meta = self._static.meta(inputs, size, self.max_model_len)
            for sampled in (False, True):
                def run(inputs: dict[str, torch.Tensor] = inputs, meta: Any = meta, sampled: bool = sampled) -> Any:
                    if FAKE_LOGITS:  # the token at p + 1 is periodic(p + 1): every n-gram draft is right
                        chosen = periodic(inputs["positions"] + 1)
                        if sampled:
                            return chosen
                        return torch.nn.functional.one_hot(chosen, self.model_config.vocab_size).float()
                    logits = self._decode_pass(inputs, meta, False)
                    return logits.argmax(dim=-1) if sampled else logits  # greedy rows: the fused kernel's argmax
                stand_in = EagerReplay(run)
                graphs = self._sampled_graphs if sampled else self._graphs
                stand_in.graph = graphs[size] = DecodeGraph(stand_in, torch.empty(0))  # type: ignore[arg-type]  # replay() only
        self._graph_sizes = sizes


def instrument(engine: InProcessEngine, spans: Spans) -> None:
    runner = engine.worker.runner
    for module, name, label in (
        (worker, "build_batch", "launch/build_batch"), (worker, "expand_rows", "launch/expand_rows"),
        (worker, "verify", "launch/verify"), (worker, "check_plan", "validate"),
        (worker, "short_drafts", "launch/propose/short_drafts"),
        (ngram_drafts, "drafting_work", "launch/propose/drafting_work"),
        (ngram_drafts, "with_drafts", "launch/propose/with_drafts"),
        (ngram_drafts, "propose_ngram", "launch/propose/propose_ngram"),
        (graph_draws, "as_decode_rows", "launch/execute/as_decode_rows"),
        (model_runner, "fill_deferred", "launch/execute/fill_deferred"),
        (batch_module.BlockTableArray if hasattr(batch_module, "BlockTableArray") else batch_module,
         "gather", "launch/build_batch/tables.gather"),
    ):
        if hasattr(module, name):
            spans.wrap(module, name, label)
    cls = type(engine.worker)
    for name, label in (("_launch", "launch"), ("_read_back", "read_back"), ("_outputs", "outputs"),
                        ("_apply_membership", "launch/membership"), ("_graph_sampling", "launch/graph_sampling"),
                        ("_draw", "launch/draw"), ("_take_input_tokens", "take_input_tokens"),
                        ("_started", "started"), ("without_hopeless", "without_hopeless")):
        if hasattr(cls, name):
            spans.wrap(cls, name, label)
    drafter = engine.worker.drafter
    if drafter is not None:
        spans.wrap(type(drafter), "propose", "launch/propose")
        spans.wrap(type(drafter), "without_hopeless", "without_hopeless")
    spans.wrap(type(runner), "execute", "launch/execute")
    spans.wrap(type(runner), "execute_sampled", "launch/execute")
    spans.wrap(GraphInputs, "upload", "launch/execute/upload")
    spans.wrap(EagerReplay, "replay", "forward", model=True)
    spans.wrap(sampler.Sampler, "__call__", "launch/draw/sampler")
    spans.wrap(sampler.Sampler, "graph_params", "launch/graph_sampling/graph_params")

    def drafting_verify(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            spans.drafting = True
            return original(*args, **kwargs)
        return call

    spans.restore.append((worker, "verify", worker.verify))
    worker.verify = drafting_verify(worker.verify)  # type: ignore[attr-defined]  # marks the step as drafting
    for loop in engine._loops:
        if loop.actor is not engine.worker:
            continue
        receive = loop.receive

        def timed_receive(sender: bytes, message: Any, receive: Any = receive) -> Any:
            before, start = spans.model, time.perf_counter()
            try:
                return receive(sender, message)
            finally:
                elapsed = time.perf_counter() - start - (spans.model - before)
                spans.current["worker total (handle + dispatch)"] += elapsed
                spans.end_step()

        loop.receive = timed_receive  # type: ignore[method-assign]  # timing only
        dispatch = loop.dispatch

        def timed_dispatch(outputs: Any, dispatch: Any = dispatch) -> Any:
            start = time.perf_counter()
            try:
                return dispatch(outputs)
            finally:
                spans.current["dispatch (encode + send, events)"] += time.perf_counter() - start

        spans.wrap(loop.endpoint, "send", "dispatch/send (encode)")
        spans.wrap(loop.publisher, "publish", "dispatch/publish (in process: the metrics store too)")
        loop.dispatch = timed_dispatch  # type: ignore[method-assign]  # timing only
    network = engine._network
    post = network.post

    def timed_post(sender: bytes, destination: str, message: Any) -> None:
        start = time.perf_counter()
        post(sender, destination, message)
        if destination == "worker":
            spans.current["wire plan (encode + decode)"] += time.perf_counter() - start

    network.post = timed_post  # type: ignore[method-assign]  # timing only


def measure(model: str, num_spec: int, num_tokens: int, profile: cProfile.Profile | None) -> dict[str, Any]:
    spec = ({"method": "ngram", "num_speculative_tokens": num_spec, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
            if num_spec else None)
    config = EngineConfig(model=model, dtype="float32", device="cpu", block_size=16, max_num_seqs=4,
                          max_num_batched_tokens=256, max_model_len=2048, num_gpu_blocks_override=256,
                          speculative_config=parse_speculative_config(spec, adaptive=False) if spec else None)
    runner = StandInGraphs(config)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None if FAKE_LOGITS else "load")
    spans = Spans()
    instrument(engine, spans)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": [int(periodic(p)) for p in range(40)]} if FAKE_LOGITS else {"prompt": REPEATING}
    prepared = engine.prepare("0", prompt, params)
    engine.submit(prepared)
    if profile is not None:
        profile.enable()
    while engine.has_unfinished:
        engine.step()
    if profile is not None:
        profile.disable()
    for owner, name, original in reversed(spans.restore):
        setattr(owner, name, original)
    steps = [(drafting, phases) for drafting, phases in spans.steps if "launch" in phases][3:]  # past the prefill
    out: dict[str, Any] = {}
    for drafting in (False, True):
        chosen = [phases for was, phases in steps if was == drafting]
        if not chosen:
            continue
        keys = sorted({key for phases in chosen for key in phases})
        out["drafting" if drafting else "plain"] = {
            "steps": len(chosen),
            "us": {key: 1e6 * sum(p.get(key, 0.0) for p in chosen) / len(chosen) for key in keys},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--fake-logits", action="store_true",
                        help="the decode graphs' stand-ins give periodic tokens without a forward pass (the "
                             "model then runs only the prefill): host caches stay warm, as beside a GPU")
    parser.add_argument("--profile", action="store_true", help="cProfile's top functions of the n-gram run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    global FAKE_LOGITS
    FAKE_LOGITS = args.fake_logits
    model = args.model or default_model_path()
    for num_spec in (0, args.num_speculative_tokens):
        profile = cProfile.Profile() if args.profile and num_spec else None
        result = measure(model, num_spec, args.tokens, profile)
        for kind, figures in result.items():
            print(f"k={num_spec}, {kind} steps ({figures['steps']}), us per step (inclusive, forward passes left out):")
            for key, value in figures["us"].items():
                print(f"  {key:45s} {value:8.1f}")
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
