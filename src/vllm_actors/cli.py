"""Command line: ``vllm-actors generate | chat | serve | tap | stats | bench | chaos``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_actors.engine_args import add_engine_arguments, engine_kwargs
from vllm_actors.protocol.sampling import SamplingParams


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--stop", action="append", default=[])


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.sampling_seed,
        stop=list(args.stop),
    )


def _generate(args: argparse.Namespace) -> int:
    from vllm_actors.llm import LLM

    params = sampling_params(args)
    with LLM(args.model, **engine_kwargs(args)) as llm:
        if args.raw:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        else:
            conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        completion = output.outputs[0]
        summary = f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]"
        sys.stdout.write(f"Prompt: {prompt!r}\n{completion.text}\n{summary}\n\n")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from vllm_actors.llm import LLM

    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    with LLM(args.model, **engine_kwargs(args)) as llm:
        sys.stdout.write("Chat with the model; an empty line or Ctrl-D ends.\n")
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
            history.append({"role": "assistant", "content": reply})
            sys.stdout.write(reply + "\n")
            sys.stdout.flush()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from vllm_actors.server.serve import run_serve

    return run_serve(args, engine_kwargs(args))


def _tap(args: argparse.Namespace) -> int:
    from vllm_actors.observe.tap import group_endpoint, run_tap
    from vllm_actors.observe.tap_format import TapFilter

    address, keys = group_endpoint(args.run_dir, args.address, lambda addresses: addresses.bus_out)
    tap_filter = TapFilter(
        types=set(args.type) if args.type else None,
        actors=set(args.actor) if args.actor else None,
        request_ids=set(args.request) if args.request else None,
        replicas=set(args.replica) if args.replica else None,
    )
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not args.json)
    # Ctrl-C (SIGINT) stops the tap even when it was started with SIGINT ignored (a background job
    # of a non-interactive shell inherits that, and Python then installs no handler of its own)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run_tap(address, tap_filter, sys.stdout, as_json=args.json, color=color, max_events=args.count,
                duration=args.duration, keys=keys)
    except KeyboardInterrupt:  # a second Ctrl-C while the socket closes
        pass
    return 0


def _stats(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return _stats_trace(args)
    import msgspec

    from vllm_actors.observe.stats_text import summary_text
    from vllm_actors.observe.tap import group_endpoint, query_metrics, save_dump, stats_query
    from vllm_actors.protocol.metrics import DumpReply, ErrorReply, SummaryQuery, SummaryReply

    address, keys = group_endpoint(args.run_dir, args.address, lambda addresses: addresses.metrics)
    reply = query_metrics(address, stats_query(args.timeline, args.dump, args.replica), keys=keys)
    if isinstance(reply, DumpReply) and args.dump is not None:
        reply = save_dump(reply, args.dump)
    if isinstance(reply, ErrorReply):
        sys.stderr.write(f"error: {reply.message}\n")
        return 2
    if isinstance(reply, SummaryReply) and args.replica is None and reply.replicas:
        # A replica set: the whole group (every replica summed), then each replica's own.
        per_replica = [query_metrics(address, SummaryQuery(replica=replica), keys=keys) for replica in reply.replicas]
        if args.json:
            sys.stdout.write(msgspec.json.encode({"total": reply, "replicas": per_replica}).decode() + "\n")
            return 0
        texts = [summary_text(reply)] + [f"--- replica {each.replica} ---\n{summary_text(each)}"
                                        for each in per_replica if isinstance(each, SummaryReply)]
        sys.stdout.write("\n".join(texts) + "\n")
        return 0
    if isinstance(reply, SummaryReply) and not args.json:
        sys.stdout.write(summary_text(reply) + "\n")
    else:
        sys.stdout.write(msgspec.json.encode(reply).decode() + "\n")
    return 0


def _stats_trace(args: argparse.Namespace) -> int:
    """``stats --trace PATH``: the retained event log as a Chrome trace (with ``--dump``, the
    dump it was made from is kept there too)."""
    from vllm_actors.observe.tap import group_endpoint, query_metrics, save_dump
    from vllm_actors.observe.trace_file import max_trace_bytes, read_dump, write_trace
    from vllm_actors.protocol.metrics import DumpQuery, DumpReply

    address, keys = group_endpoint(args.run_dir, args.address, lambda addresses: addresses.metrics)
    reply = query_metrics(address, DumpQuery(), timeout_ms=120_000, keys=keys)
    if not isinstance(reply, DumpReply):
        sys.stderr.write(f"error: {getattr(reply, 'message', reply)}\n")
        return 2
    if args.dump is not None:
        reply = save_dump(reply, args.dump)
    try:
        written = write_trace(read_dump(reply.path), args.trace, max_trace_bytes(args.trace_max_mb))
    finally:
        if args.dump is None:
            Path(reply.path).unlink(missing_ok=True)
    options = written.options
    sys.stdout.write(f"trace: {written.path} ({written.num_bytes:,} bytes, {written.num_trace_events:,} trace events "
                     f"from {written.num_events:,} log events; detail {options.detail}, every "
                     f"{options.request_stride} request(s) shown"
                     + (f"; the oldest {written.num_left_out:,} log events left out" if written.num_left_out else "")
                     + ")\n")
    return 0


# ``vllm-actors bench WHICH ...``: the module whose ``main(argv)`` runs each benchmark.
BENCHMARKS = {
    "throughput": "vllm_actors.bench.throughput",
    "latency": "vllm_actors.bench.latency",
    "serve": "vllm_actors.bench.serve",
    "prefix": "vllm_actors.bench.prefix",
    "chaos": "vllm_actors.bench.chaos",
    "soak": "vllm_actors.bench.soak",
    "simulate": "vllm_actors.bench.policy_sim",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    return int(importlib.import_module(BENCHMARKS[args.which]).main(args.rest))


def _chaos(args: argparse.Namespace) -> int:
    from vllm_actors.bench.chaos import run_from_args

    return run_from_args(args)


def _models(args: argparse.Namespace) -> int:
    from vllm_actors.models import registry

    if args.markdown:
        sys.stdout.write(registry.markdown_table())
        return 0
    width = max(len(entry.architecture) for entry in registry.entries())
    for entry in registry.entries():
        gguf = ", gguf" if entry.gguf else ""
        sys.stdout.write(f"{entry.architecture:<{width}}  {entry.model_type}{gguf}: {entry.summary}\n")
    return 0


def _add_group_location(parser: argparse.ArgumentParser, address_help: str) -> None:
    parser.add_argument("--run-dir", default=None, help="the group's run directory (default: the newest running group)")
    parser.add_argument("--address", default=None, help=address_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-actors", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate text for one or more prompts")
    generate.add_argument("prompts", nargs="+")
    generate.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_arguments(generate)
    add_sampling_arguments(generate, max_tokens=128)
    generate.set_defaults(func=_generate)

    chat = commands.add_parser("chat", help="interactive chat through the model's chat template")
    chat.add_argument("--system", default=None)
    add_engine_arguments(chat)
    add_sampling_arguments(chat, max_tokens=256)
    chat.set_defaults(func=_chat)

    from vllm_actors.server.args import add_server_arguments

    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, models, health, metrics)"
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="Hugging Face directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    add_engine_arguments(serve)
    add_server_arguments(serve)
    serve.set_defaults(func=_serve)

    tap = commands.add_parser("tap", help="print the live event stream of a running group")
    _add_group_location(tap, "the bus's subscriber endpoint, e.g. ipc:///tmp/.../bus_out or tcp://host:port")
    tap.add_argument("--json", action="store_true", help="one JSON object per line")
    tap.add_argument("--type", action="append", help="event type or group (REQUEST, KV, WORKER, ACTOR); repeatable")
    tap.add_argument("--actor", action="append", help="actor id or pattern (worker-*); repeatable")
    tap.add_argument("--request", action="append", help="request id; repeatable")
    tap.add_argument("--replica", action="append", type=int,
                     help="replica index (data_parallel_size > 1: actors named <name>@<replica>); repeatable")
    tap.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    tap.add_argument("--count", type=int, default=None, help="exit after this many lines")
    tap.add_argument("--duration", type=float, default=None, help="exit after this many seconds")
    tap.set_defaults(func=_tap)

    stats = commands.add_parser("stats", help="summary of a running group's metrics store")
    _add_group_location(stats, "the metrics store's endpoint")
    stats.add_argument("--json", action="store_true")
    stats.add_argument("--trace", metavar="PATH", default=None,
                       help="write the retained event log as a Chrome trace (open it in ui.perfetto.dev; "
                            "PATH ending in .gz: gzipped)")
    stats.add_argument("--trace-max-mb", type=float, default=8.0,
                       help="size bound of --trace: merged decode slices, then every 2nd, 4th... request (0: none)")
    stats.add_argument("--timeline", metavar="REQUEST_ID", default=None, help="one request's events")
    stats.add_argument("--dump", metavar="PATH", default=None, help="write the retained event log as JSON lines")
    stats.add_argument("--replica", type=int, default=None,
                       help="one replica's summary (default: the whole group, then each replica's)")
    stats.set_defaults(func=_stats)

    bench = commands.add_parser("bench", help="benchmarks: throughput, latency, serve, prefix, chaos, soak, simulate")
    bench.add_argument("which", choices=list(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    bench.set_defaults(func=_bench)

    models = commands.add_parser("models", help="list the supported model architectures (config.json architectures)")
    models.add_argument("--markdown", action="store_true", help="the table of docs/models.md")
    models.set_defaults(func=_models)

    from vllm_actors.bench.chaos import add_chaos_arguments

    chaos = commands.add_parser("chaos", help="kill actors under load; check that no request is lost (exit 1 if any)")
    add_chaos_arguments(chaos)
    chaos.set_defaults(func=_chaos)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, TimeoutError) as error:
        sys.stderr.write(f"error: {error}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
