"""Soak: ``vllm-actors serve`` under mixed abusive load for a long time; ``--help`` lists the options.

Starts ``vllm-actors serve`` (default: the embedded default model on CPU; ``--model``) as a real
subprocess on a free loopback port, then for ``--minutes`` runs ``--clients`` concurrent clients
(asyncio + httpx), each sending requests of the mix in ``soak_load`` one after the other: valid
completions and chats (streamed or not, n 1-2), invalid values, long ``X-Request-Id`` headers,
~30 MB bodies now and then, deep JSON, invalid UTF-8, streams left after their first chunk and
request-id clashes. Every ``--sample-every`` seconds it records the resident memory of every
process of the group (the serve process and each actor, found in its process tree) and the KV
pool (the metrics store's summary, through the run directory's group.json). Once the load stops
it waits for the group to go idle, samples once more, stops the server (SIGTERM) and applies the
criteria of ``soak_report``. The JSON and a markdown table go to ``--results`` (default
``results/soak-<time>/``, git-ignored); the exit status is 1 when a criterion fails.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import structlog

from vllm_actors.bench.procfs import child_pids, free_port, rss_bytes
from vllm_actors.bench.soak_load import WEIGHTS, Result, fire, fire_clash, make_shot
from vllm_actors.bench.soak_report import Sample, Tally, build_report, format_markdown
from vllm_actors.observe.tap import query_metrics
from vllm_actors.protocol.metrics import SummaryQuery, SummaryReply
from vllm_actors.runtime.run_dir import GroupInfo, read_group_info

log = structlog.get_logger(__name__)


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded default model)")
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=8, help="largest max_tokens of a valid request")
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between memory samples")
    parser.add_argument("--baseline-minute", type=float, default=5.0, help="memory is compared with this minute's")
    parser.add_argument("--huge-every", type=float, default=60.0, help="seconds between ~30 MB bodies (0: none)")
    parser.add_argument("--hang-seconds", type=float, default=180.0, help="a request unanswered this long hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default=None, help="folder for soak.json and soak.md")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more argument for `serve` (repeat)")


# --------------------------------------------------------------------------- processes
def _actor_name(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"pid-{pid}"
    start = command.find('"actor_id":"')
    if start < 0:
        return f"pid-{pid}"
    start += len('"actor_id":"')
    return command[start:command.find('"', start)]


def _rss_mb(pid: int) -> float | None:
    size = rss_bytes(pid)
    return None if size is None else size / 2**20


def group_processes(serve_pid: int) -> dict[str, int]:
    """The serve process (``serve``) and each actor of its group, by name."""
    return {"serve": serve_pid, **{_actor_name(pid): pid for pid in child_pids(serve_pid)}}


def _summary(info: GroupInfo) -> SummaryReply | None:
    try:
        reply = query_metrics(info.addresses.metrics, SummaryQuery(), timeout_ms=10_000)
    except (TimeoutError, OSError) as error:
        log.warning("metrics store did not answer", error=str(error))
        return None
    return reply if isinstance(reply, SummaryReply) else None


async def take_sample(serve_pid: int, info: GroupInfo, minute: float) -> Sample:
    pids = group_processes(serve_pid)
    rss = {name: mb for name, pid in pids.items() if (mb := _rss_mb(pid)) is not None}
    summary = await asyncio.to_thread(_summary, info)
    return Sample(minute=minute, rss_mb=rss, pids=pids,
                  kv_blocks_in_use=None if summary is None else summary.kv_blocks_in_use,
                  running=None if summary is None else summary.running,
                  waiting=None if summary is None else summary.waiting)


# --------------------------------------------------------------------------- the load
class Soak:
    def __init__(self, args: argparse.Namespace, base_url: str, model: str) -> None:
        self.args = args
        self.base_url = base_url
        self.model = model
        self.tallies: dict[str, Tally] = {}
        self.huge_lock = asyncio.Lock()
        self.last_huge = time.monotonic()

    def record(self, result: Result) -> None:
        tally = self.tallies.setdefault(result.kind, Tally())
        tally.count(result.status, result.complete, result.problem)
        if result.problem is not None and len(tally.examples) < 3:
            tally.examples.append(f"{result.problem} (status {result.status}): {result.detail[:160]}")

    async def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1_000_003 + index)
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=None, limits=limits) as http:
            while time.monotonic() < deadline:
                kind = rng.choices(kinds, weights)[0]
                if kind == "clash":
                    for result in await fire_clash(http, rng, self.model, self.args.max_tokens,
                                                   self.args.hang_seconds):
                        self.record(result)
                    continue
                if kind == "huge":
                    if (not self.args.huge_every or self.huge_lock.locked()
                            or time.monotonic() - self.last_huge < self.args.huge_every):
                        continue
                    async with self.huge_lock:
                        self.last_huge = time.monotonic()
                        shot = await asyncio.to_thread(make_shot, kind, rng, self.model, self.args.max_tokens)
                        self.record(await fire(http, shot, self.args.hang_seconds))
                    continue
                self.record(await fire(http, make_shot(kind, rng, self.model, self.args.max_tokens),
                                       self.args.hang_seconds))

    async def run(self, serve_pid: int, info: GroupInfo) -> tuple[list[Sample], Sample]:
        started = time.monotonic()
        deadline = started + self.args.minutes * 60
        clients = [asyncio.ensure_future(self.client(i, deadline)) for i in range(self.args.clients)]
        samples = [await take_sample(serve_pid, info, 0.0)]
        for tick in itertools.count(1):
            next_at = started + tick * self.args.sample_every
            if next_at >= deadline:
                break
            await asyncio.sleep(next_at - time.monotonic())
            samples.append(await take_sample(serve_pid, info, (time.monotonic() - started) / 60))
            log.info("soak sample", minute=round(samples[-1].minute, 1), rss_mb=samples[-1].rss_mb,
                     kv_blocks_in_use=samples[-1].kv_blocks_in_use, sent=sum(t.sent for t in self.tallies.values()))
        await asyncio.gather(*clients)
        idle_by = time.monotonic() + 120
        final = await take_sample(serve_pid, info, (time.monotonic() - started) / 60)
        while (final.kv_blocks_in_use != 0 or final.running or final.waiting) and time.monotonic() < idle_by:
            await asyncio.sleep(1.0)
            final = await take_sample(serve_pid, info, (time.monotonic() - started) / 60)
        return samples, final


# --------------------------------------------------------------------------- the server
def start_serve(args: argparse.Namespace, port: int, run_root: Path, log_path: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "vllm_actors", "serve", *([args.model] if args.model else []),
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "soak",
               "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *args.serve_arg]
    env = dict(os.environ, VLLM_ACTORS_RUN_ROOT=str(run_root))
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def wait_serving(base_url: str, process: subprocess.Popen[bytes], run_root: Path, timeout: float = 600) -> GroupInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                (group_json,) = run_root.glob("*/group.json")
                return read_group_info(group_json.parent)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"serve did not become healthy within {timeout:.0f} s")


def stop_serve(process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    if process.poll() is not None:
        return
    children = child_pids(process.pid)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_soak(args: argparse.Namespace) -> int:
    results = Path(args.results or f"results/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    results.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="soak-runs-") as run_root:
        process = start_serve(args, port, Path(run_root), results / "serve.log")
        try:
            info = wait_serving(base_url, process, Path(run_root))
            soak = Soak(args, base_url, "soak")
            samples, final = asyncio.run(soak.run(process.pid, info))
        finally:
            stop_serve(process)
    report = build_report(args.minutes, args.clients, soak.tallies, samples, final, args.baseline_minute)
    (results / "soak.json").write_text(json.dumps(report.to_json(), indent=2))
    markdown = format_markdown(report)
    (results / "soak.md").write_text(markdown)
    print(markdown)
    print(f"results in {results}")
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-actors bench soak", description=__doc__.split("\n\n")[0])
    add_soak_arguments(parser)
    return run_soak(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
