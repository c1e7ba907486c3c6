"""Large and malformed bodies against a real ``vllm-actors serve``: answered with 400 or
413 while ``/health`` and small requests keep answering fast, and the server's memory back near
its baseline afterwards.

Latency is measured by a poller in a process of its own (``/health`` and ``/v1/models`` in turn,
each on the same keep-alive connection), so that the test process's own work of sending 30 MB
does not count. The bound is 1 s: before these changes ``/health`` waited 3+ s behind a 3 MB
prompt and 36-50 s behind a 30 MB one, while a loaded 2-core machine (the suite's other processes)
has delayed an unblocked answer by up to 126 ms.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.server_helpers import free_port, start_server, stop_process, wait_healthy
from vllm_actors.bench.procfs import rss_bytes
from vllm_actors.server.limits import MAX_BODY_BYTES, MIN_BODY_BYTES, RequestLimits

MAX_MODEL_LEN = 256
MAX_PROMPT_BYTES = 4_000_000  # raised from the default (8 KB here) so that a 3 MB prompt is tokenised
MAX_BODY = 6 * MAX_PROMPT_BYTES  # the default body cap that follows from it
MAX_LATENCY = 1.0  # seconds: the bound for /health and /v1/models during a large request (blocked: 3+ s)
MEMORY_SLACK = 200 * 1024 * 1024  # serve within 200 MB of its baseline after a large request
FILLER = "The quick brown fox jumps over the lazy dog. "

POLLER = r"""
import http.client, json, sys, time
host, port, stop_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
conn = http.client.HTTPConnection(host, port, timeout=120)
latencies = {"/health": [], "/v1/models": [], "/v1/completions": []}
paths = list(latencies)
small = json.dumps({"prompt": "Hello", "max_tokens": 1})
i = 0
while True:
    path = paths[i % 3]
    i += 1
    start = time.perf_counter()
    if path == "/v1/completions":
        conn.request("POST", path, body=small, headers={"content-type": "application/json"})
    else:
        conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    latencies[path].append((time.perf_counter() - start, response.status))
    if i == 3:
        print("ready", flush=True)
    try:
        open(stop_file).close()
        break
    except FileNotFoundError:
        time.sleep(0.005)
print(json.dumps(latencies), flush=True)
"""


@dataclass
class Served:
    base_url: str
    port: int
    process: subprocess.Popen[bytes]
    directory: Path


@pytest.fixture(scope="module")
def served(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("limits")
    port = free_port()
    process = start_server(tiny_qwen3, port, directory / "server.log", directory / "runs",
                           "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "256",
                           "--max-prompt-bytes", str(MAX_PROMPT_BYTES), "--disable-uvicorn-access-log")
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url, process, directory / "server.log")
        with httpx.Client(base_url=base_url, timeout=60) as client:  # warm up every path once
            assert client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
            assert client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).status_code == 200
        yield Served(base_url, port, process, directory)
    finally:
        stop_process(process)


def rss(pid: int) -> int:
    size = rss_bytes(pid)
    if size is None:
        raise AssertionError(f"no VmRSS for {pid}")
    return size


def wait_rss_within(pid: int, limit: int, timeout: float = 60.0) -> int:
    """The process's RSS once it is at most ``limit`` (the trim runs just after the answer)."""
    deadline = time.monotonic() + timeout
    while (current := rss(pid)) > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return current


def send_while_polling(served: Served, tag: str, path: str, content: bytes | Iterator[bytes],
                       headers: dict[str, str] | None = None) -> tuple[httpx.Response, dict[str, list[float]]]:
    """Send one large request while the poller measures ``/health`` and ``/v1/models``; returns the
    answer and the poller's latencies (seconds) by path."""
    stop_file = served.directory / f"stop-{tag}"
    poller = subprocess.Popen([sys.executable, "-c", POLLER, "127.0.0.1", str(served.port), str(stop_file)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert poller.stdout is not None
        assert poller.stdout.readline().strip() == "ready"
        with httpx.Client(base_url=served.base_url, timeout=300) as client:
            response = client.post(path, content=content,
                                   headers=headers or {"content-type": "application/json"})
        stop_file.touch()
        out, _ = poller.communicate(timeout=120)
    finally:
        if poller.poll() is None:
            poller.kill()
            poller.wait()
    measured = json.loads(out.strip().splitlines()[-1])
    for path_polled, entries in measured.items():
        assert all(status == 200 for _, status in entries), (path_polled, entries)
    return response, {p: [latency for latency, _ in entries] for p, entries in measured.items()}


def small_completion_works(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        reply = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def assert_fast(latencies: dict[str, list[float]], what: str) -> None:
    """``/health`` and ``/v1/models`` (answered by the server alone) within MAX_LATENCY. A small
    completion goes through the engine's processes, whose CPU time on a shared 2-core machine
    the server does not control: it must succeed (checked by the poller), and its latency is
    printed, not bounded."""
    worst = {path: round(max(values) * 1000) for path, values in latencies.items()}
    counts = {path: len(values) for path, values in latencies.items()}
    print(f"{what}: worst latency (ms) {worst} over {counts} requests")
    assert all(worst[path] < MAX_LATENCY * 1000 for path in ("/health", "/v1/models")), (what, worst, counts)


def test_a_30_mb_body_gets_413_while_others_are_answered(served: Served) -> None:
    baseline = rss(served.process.pid)
    prompt = (FILLER * (30_000_000 // len(FILLER) + 1))[:30_000_000]
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    for tag, headers in (("length", {"content-type": "application/json"}),  # refused from Content-Length
                         ("chunked", {"content-type": "application/json", "transfer-encoding": "chunked"})):
        started = time.monotonic()
        response, latencies = send_while_polling(served, tag, "/v1/completions", body if tag == "length" else
                                                 _chunks(body), headers)
        took = time.monotonic() - started
        assert response.status_code == 413, response.text
        assert response.json()["error"]["message"] == f"the request body is larger than {MAX_BODY} bytes"
        assert_fast(latencies, f"30 MB body ({tag}) answered in {took:.2f} s")
        small_completion_works(served.base_url)
        after = wait_rss_within(served.process.pid, baseline + MEMORY_SLACK)
        print(f"serve RSS: {baseline / 2**20:.0f} MB before, {after / 2**20:.0f} MB after")
        assert after <= baseline + MEMORY_SLACK, (baseline, after)


def _chunks(body: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


def test_a_3_mb_prompt_is_tokenised_off_the_event_loop(served: Served) -> None:
    baseline = rss(served.process.pid)
    prompt = (FILLER * (3_000_000 // len(FILLER) + 1))[:3_000_000]
    for path, body in (("/v1/completions", {"prompt": prompt, "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4})):
        started = time.monotonic()
        response, latencies = send_while_polling(served, path.replace("/", "_"), path, json.dumps(body).encode())
        took = time.monotonic() - started
        assert response.status_code == 400, response.text
        assert "longer than max_model_len" in response.json()["error"]["message"], response.text
        assert_fast(latencies, f"3 MB prompt to {path} tokenised and answered in {took:.2f} s")
        after = wait_rss_within(served.process.pid, baseline + MEMORY_SLACK)
        print(f"serve RSS: {baseline / 2**20:.0f} MB before, {after / 2**20:.0f} MB after")
        assert after <= baseline + MEMORY_SLACK, (path, baseline, after)
    small_completion_works(served.base_url)


def test_text_over_the_byte_limit_and_token_lists_over_max_model_len_get_400_untokenised(served: Served) -> None:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        response = client.post("/v1/completions", json={"prompt": "a" * (MAX_PROMPT_BYTES + 1), "max_tokens": 2})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == (
            f"prompt: the prompt is longer than the {MAX_PROMPT_BYTES} bytes a prompt may have "
            f"({MAX_PROMPT_BYTES + 1} characters)")
        chat = {"messages": [{"role": "user", "content": "é" * (MAX_PROMPT_BYTES // 2)}], "max_tokens": 2}
        response = client.post("/v1/chat/completions", json=chat)  # 2 bytes a character: over once rendered
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
        assert "bytes a prompt may have" in response.json()["error"]["message"]
        for prompt in (list(range(1, 200)) * 5000, [list(range(1, 200)) * 5000]):
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert response.status_code == 400
            assert response.json()["error"]["message"] == (
                f"prompt: 995000 tokens is longer than max_model_len ({MAX_MODEL_LEN})")
    small_completion_works(served.base_url)


@pytest.mark.parametrize(("name", "body", "content_type", "expected"), [
    ("100,000-deep JSON", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json",
     "nested too deeply"),
    ("deep chat_template_kwargs", b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}}", "application/json", "nested too deeply"),
    ("invalid UTF-8", b'{"prompt": "a\xc3(b", "max_tokens": 2}', "application/json", "not valid UTF-8"),
    ("form-encoded", b"prompt=hello&max_tokens=3", "application/x-www-form-urlencoded",
     "must be JSON (Content-Type: application/json)"),  # 415: the media type
])
def test_undecodable_bodies_get_400(served: Served, name: str, body: bytes, content_type: str, expected: str) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        response = client.post(path, content=body, headers={"content-type": content_type})
        status = 415 if name == "form-encoded" else 400
        assert response.status_code == status, (name, response.status_code, response.text)
        error = response.json()["error"]
        assert expected in error["message"], (name, error)
        assert response.headers.get("connection") != "close", name  # keep-alive kept: no 500
        assert client.get("/health").status_code == 200


def test_default_limits_follow_max_model_len() -> None:
    tiny = RequestLimits.for_model(256)
    assert tiny.max_prompt_bytes == 256 * 32 and tiny.max_body_bytes == MIN_BODY_BYTES
    qwen = RequestLimits.for_model(40960)
    assert qwen.max_prompt_bytes == 40960 * 32 and qwen.max_body_bytes == 6 * 40960 * 32
    huge = RequestLimits.for_model(1_000_000)
    assert huge.max_body_bytes == MAX_BODY_BYTES
    assert RequestLimits.for_model(256, max_prompt_bytes=10, max_body_bytes=20) == RequestLimits(20, 10)
    with pytest.raises(ValueError, match="positive"):
        RequestLimits.for_model(256, max_prompt_bytes=0)


def test_text_limits_refuse_before_tokenising_and_before_listing_ids(tiny_qwen3: Path) -> None:
    from vllm_actors.actors.frontend.text import tokenize_chat, tokenize_prompt
    from vllm_actors.actors.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_qwen3)
    text = FILLER * 1000  # 45,000 characters: tokenised through encode_batch_fast
    assert tokenize_prompt(tokenizer, text)[1] == tokenizer.backend.encode(text).ids
    with pytest.raises(ValueError, match=r"^prompt: the prompt is longer than the 100 bytes a prompt may have \(101 "):
        tokenize_prompt(tokenizer, "é" * 50 + "a", max_bytes=100)  # 51 characters, 101 bytes
    with pytest.raises(ValueError, match=r"^prompt: \d+ tokens is longer than max_model_len \(256\)"):
        tokenize_prompt(tokenizer, text, max_tokens=256)
    with pytest.raises(ValueError, match=r"^prompt: 300 tokens is longer than max_model_len \(256\)"):
        tokenize_prompt(tokenizer, {"prompt_token_ids": ["not checked"] * 300}, max_tokens=256)
    chat = [{"role": "user", "content": text}]
    with pytest.raises(ValueError, match=r"^messages: the message contents are 45000 characters"):
        tokenize_chat(tokenizer, chat, max_bytes=1000)
    with pytest.raises(ValueError, match=r"^messages: \d+ tokens is longer than max_model_len \(256\)"):
        tokenize_chat(tokenizer, chat, max_tokens=256)


def test_long_text_work_runs_on_the_pool_and_short_on_the_loop() -> None:
    import asyncio
    import threading

    from vllm_actors.clients.async_text import OFF_LOOP_CHARS, TextPool

    async def run() -> tuple[str, str]:
        pool = TextPool("test")
        try:
            short = await pool.run(lambda: threading.current_thread().name, OFF_LOOP_CHARS - 1)
            long = await pool.run(lambda: threading.current_thread().name, OFF_LOOP_CHARS)
        finally:
            pool.close()
        return short, long

    short, long = asyncio.run(run())
    assert short == threading.main_thread().name and long.startswith("test-text")
