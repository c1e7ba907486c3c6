"""One large request against ``vllm-actors serve`` while ``/health`` is polled: how long
the server takes to answer it, the longest ``/health`` wait meanwhile, and the serve process's
resident memory before, at its peak and after.

    python benchmarks/large_body.py --model path/to/model --megabytes 30 [-- serve flags...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from vllm_actors.bench.procfs import free_port, rss_bytes

FILLER = "The quick brown fox jumps over the lazy dog. "


def _rss(pid: int) -> int:
    return rss_bytes(pid) or 0


def _wait_healthy(base: str, process: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"serve exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("serve did not become healthy")


def measure(model: str, megabytes: float, serve_args: list[str], settle: float) -> dict[str, object]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as run_root:
        env = dict(os.environ, VLLM_ACTORS_RUN_ROOT=run_root)
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm_actors", "serve", model, "--host", "127.0.0.1", "--port", str(port),
             "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", *serve_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            _wait_healthy(base, process)
            httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
            baseline = _rss(process.pid)
            size = int(megabytes * 1_000_000)
            body = json.dumps({"prompt": (FILLER * (size // len(FILLER) + 1))[:size], "max_tokens": 4}).encode()
            waits: list[float] = []
            peak = [baseline]
            done = threading.Event()

            def poll() -> None:
                with httpx.Client(base_url=base, timeout=600) as client:
                    while not done.is_set():
                        started = time.perf_counter()
                        client.get("/health")
                        waits.append(time.perf_counter() - started)
                        peak[0] = max(peak[0], _rss(process.pid))
                        time.sleep(0.01)

            poller = threading.Thread(target=poll)
            poller.start()
            started = time.perf_counter()
            response = httpx.post(f"{base}/v1/completions", content=body,
                                  headers={"content-type": "application/json"}, timeout=600)
            took = time.perf_counter() - started
            done.set()
            poller.join()
            time.sleep(settle)  # what the process keeps, once the request is long over
            after = _rss(process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    mb = 1024 * 1024
    return {"body_mb": round(len(body) / 1e6, 1), "status": response.status_code, "answered_s": round(took, 2),
            "health_polls": len(waits), "health_max_wait_s": round(max(waits, default=0.0), 3),
            "rss_mb": {"before": round(baseline / mb), "peak": round(peak[0] / mb), "after": round(after / mb)},
            "error": response.json().get("error", {}).get("message", "")[:160] if response.status_code >= 400 else ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--megabytes", type=float, default=30.0, help="size of the prompt text")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before the RSS after is read")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then flags for vllm-actors serve")
    args = parser.parse_args(argv)
    serve_args = [a for a in args.serve_args if a != "--"]
    print(json.dumps(measure(args.model, args.megabytes, serve_args, args.settle)))
    return 0
