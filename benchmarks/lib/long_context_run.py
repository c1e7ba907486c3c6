"""``benchmarks/long_context.py``'s measurement: one engine in a process of its own, one request (or
``--batch`` of them) at a time, TTFT and decode at each long context.

Every engine runs this ``run_engine`` loop: vLLM and SGLang through ``peer_long.py`` (a script run by the
peer's Python beside a copy of this file, which therefore imports only the standard library), ours
through ``long_context_ours.py``; so every engine is measured alike, by the client's clock:

* the engine starts once (timed) for ``--max-model-len``, then one short request warms it up;
* per context: an optional warm-up request at the context (discarded), then ``repeats`` samples,
  each a fresh random prompt of ``prompt_len(context, output_len)`` tokens (no prefix-cache hit;
  the same prompts for every engine) streamed for ``--output-len`` tokens at temperature 0.6 with
  EOS ignored;
* a sample's TTFT is the time from the call to its first token; its decode ms/token is
  (last token's time - first token's) / (tokens - 1), from the per-token arrival times (no prefill
  noise, which at 1M tokens outweighs the whole decode); the subtraction (median full time -
  median TTFT) / (tokens - 1) is kept beside it as a cross-check.

The result JSON is rewritten after every context, so a run cut short keeps what it measured.

With ``--prefill-probe-tokens P`` a context's prompt is not run to its end (a million tokens of the
8B shape take minutes): the engine, started for the whole context, is first given the context's
full prompt for ``--admit-seconds`` (admitted: no error in that time, then aborted; an engine with
no ``admit`` is not asked), then the samples are fresh prompts of P tokens, the first chunks of
the context's prefill: their TTFT gives the prefill rate (P / TTFT), and decode is measured there,
at P tokens of context.

With ``--batch N`` a sample is N fresh prompts of the context submitted at once (``stream_batch``): its TTFT is
the median of theirs, and decode is the time of one step while all N decode (from the last first token to the
first request's end) over the tokens each request gained in it: ms a step, N tokens a step.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

TEMPERATURE = 0.6
PROMPT_MARGIN = 16  # tokens of the context left free beyond the prompt and the output
WARMUP_PROMPT = 1024  # tokens of the short warm-up request's prompt (less if the context is shorter)
TOKEN_RANGE = 10000  # prompt token ids are drawn below this (then folded into the vocabulary)

# (seconds since the call, tokens received so far), one entry per update that brought tokens
Events = list[tuple[float, int]]


ADMIT_SECONDS = 10.0


class Engine(Protocol):
    name: str

    def start(self) -> dict[str, Any]:
        """Start the engine; its resolved settings."""

    def stream(self, prompt: list[int], max_tokens: int) -> Events:
        """One request alone, its token arrivals by the client's clock. An engine that takes ``--batch``
        also has ``stream_batch(prompts, max_tokens) -> list[Events]``: the prompts submitted at once."""

    def shutdown(self) -> None: ...


# --------------------------------------------------------------------------- prompts and samples
def prompt_len(context: int, output_len: int) -> int:
    """The prompt of a ``context``-token request: the prompt and the output fill the context but a margin."""
    length = context - output_len - PROMPT_MARGIN
    if length < 1:
        raise ValueError(f"context {context} leaves no prompt for {output_len} output tokens "
                         f"(and a margin of {PROMPT_MARGIN})")
    return length


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(TOKEN_RANGE) % vocab_size for _ in range(length)]


def shape_sample(events: Events, max_tokens: int) -> dict[str, Any]:
    """One streamed request's figures from its token arrivals."""
    if not events or events[-1][1] < 1:
        raise RuntimeError("the request produced no token")
    (first_s, first_n), (last_s, last_n) = events[0], events[-1]
    decode = (last_s - first_s) / (last_n - first_n) * 1e3 if last_n > first_n else None
    return {"ttft_s": first_s, "full_s": last_s, "tokens": last_n, "complete": last_n == max_tokens,
            "updates": len(events), "decode_ms_per_token": decode,
            "times_s": [round(t, 6) for t, _ in events]}


def tokens_at(events: Events, moment: float) -> int:
    """Tokens a request had received by ``moment`` (its events in time order)."""
    return max((count for time_s, count in events if time_s <= moment), default=0)


def shape_batch_sample(streams: Sequence[Events], max_tokens: int) -> dict[str, Any]:
    """A batch's figures from its requests' token arrivals: TTFT the median of theirs; decode the time
    from the last first token to the first request's end over the tokens each gained meanwhile (the
    median): one step's time while every request decodes."""
    samples = [shape_sample(events, max_tokens) for events in streams]
    all_first = max(s["ttft_s"] for s in samples)
    first_end = min(s["full_s"] for s in samples)
    gained = statistics.median(tokens_at(e, first_end) - tokens_at(e, all_first) for e in streams)
    decode = (first_end - all_first) / gained * 1e3 if gained > 0 else None
    return {"ttft_s": statistics.median(s["ttft_s"] for s in samples), "full_s": max(s["full_s"] for s in samples),
            "tokens": min(s["tokens"] for s in samples), "complete": all(s["complete"] for s in samples),
            "updates": sum(s["updates"] for s in samples), "decode_ms_per_token": decode, "batch": len(samples),
            "all_first_token_s": all_first, "decode_window_s": first_end - all_first, "decode_steps": gained}


def summarize(context: int, length: int, output_len: int, samples: Sequence[dict[str, Any]],
              warmup_s: float | None) -> dict[str, Any]:
    """A context's medians over its samples (decode from the token arrivals, and the subtraction)."""
    ttft = statistics.median(s["ttft_s"] for s in samples)
    full = statistics.median(s["full_s"] for s in samples)
    streamed = [s["decode_ms_per_token"] for s in samples if s["decode_ms_per_token"] is not None]
    subtract = (full - ttft) / (output_len - 1) * 1e3 if output_len > 1 else None
    return {
        "context": context, "prompt_len": length, "output_len": output_len, "repeats": len(samples),
        "ttft_ms": ttft * 1e3, "decode_ms_per_token": statistics.median(streamed) if streamed else subtract,
        "decode_method": "token_times" if streamed else "subtraction",
        "decode_subtract_ms_per_token": subtract, "full_s": full, "warmup_s": warmup_s,
        "complete": all(s["complete"] for s in samples), "samples": list(samples),
    }


def measure_batch(stream_batch: Callable[[list[list[int]], int], list[Events]], context: int, output_len: int,
                  repeats: int, warmup: bool, batch: int, seed: int, vocab_size: int) -> dict[str, Any]:
    """``repeats`` samples of ``batch`` fresh prompts of the context at once (``shape_batch_sample``),
    after a discarded one with ``warmup``."""
    length = prompt_len(context, output_len)
    rng = random.Random(seed * 1_000_003 + context)  # the same prompts for every engine
    warmup_s = None
    samples = []
    for index in range(repeats + warmup):
        prompts = [random_prompt(rng, length, vocab_size) for _ in range(batch)]
        sample = shape_batch_sample(stream_batch(prompts, output_len), output_len)
        if warmup and index == 0:
            warmup_s = sample["full_s"]
        else:
            samples.append(sample)
    entry = summarize(context, length, output_len, samples, warmup_s)
    entry.update(batch=batch, decode_method="batch_steps")
    return entry


def measure_context(stream: Callable[[list[int], int], Events], context: int, output_len: int, repeats: int,
                    warmup: bool, seed: int, vocab_size: int,
                    first_sample: Callable[[list[int], int], Events] | None = None) -> dict[str, Any]:
    """``first_sample``: what streams the first measured sample instead of ``stream`` (a traced one)."""
    length = prompt_len(context, output_len)
    rng = random.Random(seed * 1_000_003 + context)  # the same prompts for every engine
    warmup_s = None
    if warmup:
        prompt = random_prompt(rng, length, vocab_size)
        warmup_s = shape_sample(stream(prompt, output_len), output_len)["full_s"]
    samples = []
    for index in range(repeats):
        prompt = random_prompt(rng, length, vocab_size)
        call = first_sample if index == 0 and first_sample is not None else stream
        samples.append(shape_sample(call(prompt, output_len), output_len))
    return summarize(context, length, output_len, samples, warmup_s)


def probe_context(engine: Engine, context: int, output_len: int, probe_tokens: int, repeats: int, seed: int,
                  vocab_size: int, admit_seconds: float,
                  first_sample: Callable[[list[int], int], Events] | None = None) -> dict[str, Any]:
    """The context's full prompt offered for ``admit_seconds`` (where the engine can ``admit``), then
    ``repeats`` samples of ``probe_tokens`` prompt tokens: the prefill rate of the context's first chunks."""
    length = prompt_len(context, output_len)
    if not 0 < probe_tokens < length:
        raise ValueError(f"--prefill-probe-tokens {probe_tokens} must be below the context's prompt ({length})")
    admit = getattr(engine, "admit", None)
    admission: dict[str, Any] = {"prompt_len": length, "checked": admit is not None}
    if admit is not None:
        prompt = random_prompt(random.Random(seed * 1_000_003 + context), length, vocab_size)
        started = time.perf_counter()
        refused = admit(prompt, admit_seconds)
        admission.update(admitted=refused is None, error=refused, seconds=time.perf_counter() - started)
        if refused is not None:
            raise RuntimeError(f"the {length:,}-token prompt was refused: {refused}")
    probe_context_len = probe_tokens + output_len + PROMPT_MARGIN  # a context whose prompt is the probe
    entry = measure_context(engine.stream, probe_context_len, output_len, repeats, False, seed, vocab_size,
                            first_sample)
    entry.update(context=context, admission=admission,
                 probe={"prompt_tokens": probe_tokens, "prefill_tok_s": probe_tokens / entry["ttft_ms"] * 1e3})
    return entry


# --------------------------------------------------------------------------- the run
def _write(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1, default=str)


def run_engine(engine: Engine, args: argparse.Namespace) -> int:
    """Start, warm up, every context in order, shut down; the JSON at ``args.out`` after each part."""
    result: dict[str, Any] = {"engine": engine.name, "python": sys.version.split()[0], "args": vars(args),
                              "contexts": {}}
    started = time.perf_counter()
    try:
        result["settings"] = engine.start()
    except Exception as error:
        result["error"] = f"startup: {type(error).__name__}: {error}"
        _write(args.out, result)
        raise
    result["startup_s"] = time.perf_counter() - started
    batch = getattr(args, "batch", 1)
    stream_batch = getattr(engine, "stream_batch", None)
    print(f"{engine.name}: engine up after {result['startup_s']:.1f} s", flush=True)
    if batch > 1 and stream_batch is None:
        engine.shutdown()
        result["error"] = f"{engine.name} cannot run --batch {batch} (it has no stream_batch)"
        _write(args.out, result)
        raise RuntimeError(result["error"])
    _write(args.out, result)
    try:
        warm_len = min(WARMUP_PROMPT, prompt_len(min(args.contexts), args.output_len))
        prompt = random_prompt(random.Random(args.seed - 1), warm_len, args.vocab_size)
        result["warmup_s"] = shape_sample(engine.stream(prompt, args.output_len), args.output_len)["full_s"]
        # an engine that traces (ours with --trace-dir): traced_stream(context, prompt, max_tokens) streams
        # the first measured sample of each context and keeps what it found in traces[context]
        traced = getattr(engine, "traced_stream", None)
        for context, repeats, warmup in zip(args.contexts, args.repeats, args.warmup, strict=True):
            try:
                first = functools.partial(traced, context) if traced is not None else None
                if batch > 1:
                    entry = measure_batch(stream_batch, context, args.output_len, repeats, bool(warmup), batch,
                                          args.seed, args.vocab_size)
                elif args.prefill_probe_tokens:
                    entry = probe_context(engine, context, args.output_len, args.prefill_probe_tokens, repeats,
                                          args.seed, args.vocab_size, args.admit_seconds, first)
                else:
                    entry = measure_context(engine.stream, context, args.output_len, repeats, bool(warmup), args.seed,
                                            args.vocab_size, first)
                found = getattr(engine, "traces", {}).get(context)
                if found is not None:
                    entry["trace"] = found
                print(f"{engine.name} {context}: TTFT {entry['ttft_ms']:,.1f} ms, "
                      f"{entry['decode_ms_per_token']:.3f} ms/token", flush=True)
            except Exception as error:  # the next context may still fit
                entry = {"context": context, "error": f"{type(error).__name__}: {error}"}
                print(f"{engine.name} {context}: {entry['error']}", flush=True)
            result["contexts"][str(context)] = entry
            _write(args.out, result)
    except Exception as error:  # the warm-up failed: nothing else can run
        result["error"] = f"warm-up: {type(error).__name__}: {error}"
        _write(args.out, result)
        raise
    finally:
        engine.shutdown()
    _write(args.out, result)
    return 0 if all("error" not in entry for entry in result["contexts"].values()) else 1


# --------------------------------------------------------------------------- arguments
def build_parser(engines: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one engine's side of the long-context benchmark")
    parser.add_argument("--engine", required=True, choices=tuple(engines))
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", required=True, help="tokens, in order")
    parser.add_argument("--repeats", type=int, nargs="+", required=True, help="samples, one per context")
    parser.add_argument("--warmup", type=int, nargs="+", required=True,
                        help="1: a discarded request at the context first; one per context")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--kv-parallel-size", type=int, default=1, help="ours only")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=None, help="KV block (page) size; default: the engine's")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="SGLang's; its default if not given")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--prefill-probe-tokens", type=int, default=None,
                        help="measure prompts of this many tokens after offering each context's full prompt")
    parser.add_argument("--admit-seconds", type=float, default=ADMIT_SECONDS,
                        help="with --prefill-probe-tokens: how long the full prompt runs before it is aborted")
    parser.add_argument("--batch", type=int, default=1,
                        help="prompts of each context submitted at once (decode: ms a step of them all)")
    if "ours" in engines:
        parser.add_argument("--trace-dir", default=None,
                            help="ours: each context's first measured prefill traced into this directory")
    return parser


def parse_args(argv: Sequence[str] | None, engines: Sequence[str]) -> argparse.Namespace:
    parser = build_parser(engines)
    args = parser.parse_args(argv)
    if not len(args.contexts) == len(args.repeats) == len(args.warmup):
        parser.error("--contexts, --repeats and --warmup need one value per context")
    if args.output_len < 2 or min(args.repeats) < 1:
        parser.error("--output-len must be at least 2 and every --repeats at least 1")
    if args.batch < 1 or (args.batch > 1 and args.prefill_probe_tokens):
        parser.error("--batch must be at least 1, and 1 with --prefill-probe-tokens")
    for context in args.contexts:
        if context > args.max_model_len:
            parser.error(f"context {context} is longer than --max-model-len {args.max_model_len}")
        try:
            prompt_len(context, args.output_len)
        except ValueError as error:
            parser.error(str(error))
    return args
