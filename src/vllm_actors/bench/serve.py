"""``vllm-actors bench serve``: online serving benchmark against this engine's server, vLLM's, or
any OpenAI-compatible URL.

For each server (``--engines ours vllm``, started here one after the other on the same model
directory, or ``--url``), after a warm-up, each load in turn: Poisson arrivals at ``--rates``
requests/s for ``--duration`` seconds, or ``--concurrencies`` closed loops for as long. The client
(serve_client.py) runs in ``--num-clients`` processes and streams ``/v1/completions`` with random
token-id prompts: a ShareGPT-like log-normal mix of 128-1024 prompt tokens and 64-512 output
tokens (``ignore_eos``), so both servers do the same work. The prompts of each load are drawn from
their own seed (no prefix-cache hits across loads), the same for every server.

Reported per server and load: requests, failures, output tok/s, TTFT / inter-token / end-to-end
p50, p90, p99, and goodput under the SLO (TTFT <= ``--slo-ttft-ms`` and the request's own p99
inter-token gap <= ``--slo-itl-ms``): the share of requests sent that met it, and their rate.
Outputs under ``--out`` (serve_report.py): ``serve.json`` (rewritten after every load), ``serve.md``
(the table) and ``serve.png`` (matplotlib; skipped with a note without it).

``--workload mixed`` (serve_mixed.py) sends interactive requests (short, tight TTFT and inter-token
targets, a lower ``priority``) and long batch requests (loose targets) in on/off bursts, and reports
each class's SLO attainment; ``--scheduling-policies fcfs priority edf lrs`` starts our server once
per policy on the same requests (serve_policies.py): ``slo.png`` and an attainment table in
``serve.md``. ``--trace PATH`` writes each of our servers' event logs as a Chrome trace.

With no ``--model``, the model directory is Qwen3-0.6B's shape with random weights
(``--load-format dummy`` for both servers) and a word-level tokenizer over its 151,936 ids
("t0", "t1", ...), so that both servers detokenize every token as they would a real model's.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_actors.bench import procfs, serve_delays, serve_long
from vllm_actors.bench.serve_client import (
    INPUT_LEN_RANGE,
    OUTPUT_LEN_RANGE,
    make_requests,
    poisson_requests,
    run_load,
    split_load,
    summarize,
)
from vllm_actors.bench.serve_policies import (
    add_mixed_arguments,
    check_arguments,
    load_mixed,
    policy_arguments,
    save_trace,
    server_name,
    servers,
    slo_row,
    slo_summary,
    trace_env,
    trace_path,
)
from vllm_actors.bench.serve_report import _RECORDS, HEADER, _load_label, format_row, markdown, merge, write_outputs
from vllm_actors.bench.serve_server import (  # noqa: F401 - importable from here as before
    VLLM_ENV,
    Server,
    http_json,
    served_model,
    server_command,
    server_env,
    sglang_settings,
    write_model_dir,
)
from vllm_actors.bench.throughput_workload import MODEL_SHAPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-actors bench serve", description=__doc__.split("\n\n")[0])
    target = parser.add_argument_group("servers")
    target.add_argument("--engines", nargs="+", choices=("ours", "vllm", "sglang"), default=["ours"],
                        help="servers to start, in this order (each stopped before the next starts)")
    target.add_argument("--url", default=None, help="drive this running server instead (e.g. http://host:8000)")
    target.add_argument("--label", default=None,
                        help="the --url server's name in the report; with started servers, added to each "
                        "one's name (e.g. 'dp2' when --server-args '-dp 2')")
    target.add_argument("--model", default=None, help="model directory (default: random Qwen3-0.6B shape)")
    target.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b",
                        help="without --model: the shape of the random weights (max_position_embeddings raised to "
                             "--max-model-len where that is longer, as benchmarks/long_context.py does)")
    target.add_argument("--load-format", default=None, help="default: dummy without --model, auto with it")
    target.add_argument("--dtype", default="bfloat16")
    target.add_argument("--max-model-len", type=int, default=4096)
    target.add_argument("--max-num-seqs", type=int, default=256)
    target.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    target.add_argument("--port", type=int, default=8123)
    target.add_argument("--server-args", default="", help="extra arguments for every started server (one string)")
    target.add_argument("--vllm-python", default=sys.executable)
    target.add_argument("--vllm-pythonpath", default="/tmp/vsite",
                        help="PYTHONPATH for vLLM's server (its packages; '' to keep ours)")
    target.add_argument("--sglang-python", default=sys.executable)
    target.add_argument("--sglang-pythonpath", default="/tmp/ssite",
                        help="PYTHONPATH for SGLang's server (benchmarks/kits/sglang installs it there)")
    target.add_argument("--sglang-args", default="--attention-backend fa3",
                        help="SGLang's server only (one string); its --server-args are not ours "
                             "(default: fa3, what SGLang picks for dense models on Hopper, named so that no "
                             "other backend is compiled)")
    target.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for a server to be up")

    load = parser.add_argument_group("load")
    load.add_argument("--rates", type=float, nargs="*", default=[0.5, 20.0, 40.0], help="Poisson requests/s")
    load.add_argument("--concurrencies", type=int, nargs="*", default=[],
                      help="closed loops of this many requests in flight (instead of --rates)")
    load.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per load")
    load.add_argument("--num-clients", type=int, default=4, help="client processes")
    load.add_argument("--input-len", type=int, nargs=2, default=list(INPUT_LEN_RANGE), metavar=("MIN", "MAX"))
    load.add_argument("--output-len", type=int, nargs=2, default=list(OUTPUT_LEN_RANGE), metavar=("MIN", "MAX"))
    load.add_argument("--temperature", type=float, default=0.6)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup-requests", type=int, default=24, help="concurrent short requests before the loads")
    load.add_argument("--request-timeout", type=float, default=300.0)
    load.add_argument("--slo-ttft-ms", type=float, default=200.0)
    load.add_argument("--slo-itl-ms", type=float, default=50.0, help="bound on each request's p99 inter-token gap")

    add_mixed_arguments(parser)
    serve_long.add_long_arguments(parser)
    parser.add_argument("--out", default="results/serve")
    parser.add_argument("--merge", nargs="+", default=None, metavar="SERVE_JSON",
                        help="measure nothing: put the servers of these serve.json files (e.g. runs of separate "
                             "device calls) into one serve.json / serve.md / serve.png under --out, without "
                             "their per-request rows")
    return parser


# --------------------------------------------------------------------------- loads
def shape_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--model-shape``'s config.json, its ``max_position_embeddings`` at least ``--max-model-len``
    (llama3 rope scaling reads ``original_max_position_embeddings``: the arithmetic is unchanged)."""
    config = dict(MODEL_SHAPES[args.model_shape])
    config["max_position_embeddings"] = max(int(config["max_position_embeddings"]), args.max_model_len)
    return config


def loads(args: argparse.Namespace) -> list[tuple[str, float]]:
    if args.concurrencies:
        return [("concurrency", float(c)) for c in args.concurrencies]
    return [run for rate in args.rates for run in serve_long.load_kinds(args, "rate", rate)]


def load_requests(args: argparse.Namespace, kind: str, value: float, seed: int) -> list[Any]:
    input_range: tuple[int, int] = (args.input_len[0], args.input_len[1])
    output_range: tuple[int, int] = (args.output_len[0], args.output_len[1])
    if kind == "rate" and args.workload == "mixed":
        return load_mixed(args, value, seed)
    if kind == serve_long.LONG_KIND:  # the same short requests as the rate's run alone, and the long one
        return serve_long.with_long(args, load_requests(args, "rate", value, seed), seed)
    if kind == "rate":
        return poisson_requests(value, args.duration, seed, input_range=input_range, output_range=output_range)
    return make_requests(int(value * args.duration * 4 + 16), seed, input_range, output_range)


def warm_up(args: argparse.Namespace, url: str, model: str) -> float:
    started = time.monotonic()
    if args.warmup_requests <= 0:
        return 0.0
    requests = make_requests(args.warmup_requests + 2, args.seed + 999_999, tuple(args.input_len), (16, 32))
    for first in requests[:2]:  # two alone, then a burst
        run_load(split_load(completions_url(url), model, [first], 1, temperature=args.temperature,
                            timeout=args.request_timeout), in_process=True)
    run_load(split_load(completions_url(url), model, requests[2:], 1, temperature=args.temperature,
                        timeout=args.request_timeout), in_process=True)
    return time.monotonic() - started


def completions_url(url: str) -> str:
    return f"{url.rstrip('/')}/v1/completions"


def measure(args: argparse.Namespace, url: str, model: str, name: str, record: dict[str, Any], out: Path,
            server_pid: int | None = None) -> None:
    """Every load against ``url``; with ``server_pid`` (a server this benchmark started), also the
    CPU each of its roles used over the load (``server_cpu``: cores, 1.0 a core busy all along)."""
    record["warmup_s"] = warm_up(args, url, model)
    alone: tuple[list[Any], float] | None = None  # the last rate's run without the long request
    for index, (kind, value) in enumerate(loads(args)):
        seed = args.seed + 1000 * (index + (0 if kind == serve_long.LONG_KIND else 1))  # the run alone's
        requests = load_requests(args, kind, value, seed)
        concurrency = int(value) if kind == "concurrency" else 0
        shards = split_load(completions_url(url), model, requests, args.num_clients, temperature=args.temperature,
                            timeout=args.request_timeout, concurrency=concurrency, duration=args.duration)
        delays_before = serve_delays.scrape(url)
        cpu_before, wall_before = (procfs.cpu_by_role(server_pid), time.monotonic()) if server_pid else ({}, 0.0)
        results, start = run_load(shards)
        cpu = procfs.cpu_shares(cpu_before, procfs.cpu_by_role(server_pid), time.monotonic() - wall_before) \
            if server_pid else {}
        delays = serve_delays.difference(delays_before, serve_delays.scrape(url))
        summary = summarize(results, start, args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
        summary.update({"kind": kind, "value": value, "sent": len(results), "client_processes": len(shards)})
        if delays:  # this engine's servers: where the tokens' way to the client was spent
            summary["server_delays"] = delays
        if cpu:
            summary["server_cpu"] = cpu
        if args.workload == "mixed":
            summary["slo"] = slo_summary(args, results, requests, start)
        if kind == serve_long.LONG_KIND:
            baseline, baseline_start = alone or (None, 0.0)
            summary["long"] = serve_long.long_summary(results, baseline, start, baseline_start)
        alone = (results, start) if kind == "rate" else None
        klass = {request.index: getattr(request, "klass", None) for request in requests}
        summary["per_request"] = [
            {"i": r.index, "in": r.prompt_len, "out": r.output_tokens, "t0": round(r.start - start, 4),
             "ttft": round(r.ttft, 5), "e2e": round(r.e2e, 4), "ok": r.ok, **({"error": r.error} if r.error else {}),
             **({"class": klass[r.index]} if klass[r.index] else {})}
            for r in results
        ]
        record["loads"].append(summary)
        print(format_row(name, summary), flush=True)
        if delays:
            print(f"{name} {_load_label(summary)}: {serve_delays.describe(delays)}", flush=True)
        if cpu:
            shares = ", ".join(f"{role} {cores:.2f}" for role, cores in cpu.items())
            print(f"{name} {_load_label(summary)}: server CPU in cores: {shares}", flush=True)
        if "slo" in summary:
            print(slo_row(name, summary, None), flush=True)
        if "long" in summary:
            print(serve_long.describe(name, summary), flush=True)
        write_outputs(out, args, None)


# --------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> int:
    if args.merge:
        return merge(args.merge, Path(args.out))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _RECORDS.clear()
    status = 0
    print(HEADER, flush=True)
    if args.url:
        url = args.url.rstrip("/")
        record: dict[str, Any] = {"name": args.label or url, "url": url, "loads": []}
        _RECORDS.append(record)
        measure(args, url, served_model(url), record["name"], record, out)
        write_outputs(out, args, True)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        model = args.model or str(write_model_dir(Path(scratch) / f"{args.model_shape}-shape", shape_config(args)))
        load_format = args.load_format or ("dummy" if args.model is None else "auto")
        url = f"http://127.0.0.1:{args.port}"
        started = servers(args)
        for engine, policy in started:
            name = server_name(engine, policy) + (f" {args.label}" if args.label else "")
            record = {"name": name, "engine": engine, "loads": [], **({"policy": policy} if policy else {})}
            _RECORDS.append(record)
            command = server_command(engine, args, model, load_format) + policy_arguments(policy)
            record["command"] = " ".join(shlex.quote(part) for part in command)
            log_name = f"server-{engine}" + (f"-{policy}" if policy else "")
            traced = trace_path(args, engine, policy, len(started) > 1)
            env = {**server_env(engine, args), **(trace_env(args) if traced is not None else {})}
            server = Server(engine, command, env, out / f"{log_name}.log")
            try:
                served = server.wait_ready(url, args.server_timeout)
                record["startup_s"] = server.startup_s
                record["version"] = _version(url)
                if engine == "sglang":
                    record["settings"] = sglang_settings(url)
                    record["version"] = str(record["settings"].get("version") or "")
                print(f"{name} up after {server.startup_s:.1f} s", flush=True)
                measure(args, url, served, name, record, out, server_pid=server.process.pid)
                if traced is not None:
                    record["trace"] = save_trace(server.process.pid, traced, args.trace_max_mb)
                    print(f"{name} trace: {record['trace']}", flush=True)
            except Exception as error:
                record["error"] = f"{type(error).__name__}: {error}"[:2000]
                print(f"{name} failed: {record['error']}", flush=True)
                status = 1
            finally:
                server.stop()
            write_outputs(out, args, False)
    write_outputs(out, args, True)
    print(markdown(args), flush=True)
    return status


def _version(url: str) -> str:
    try:
        return str(http_json(f"{url}/version").get("version", ""))
    except (OSError, ValueError):
        return ""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_arguments(args)
    return run(args)
