"""vLLM's endpoints beyond completions and chat, through one real ``vllm-actors serve`` (tiny
checkpoint, float32, CPU) that serves HTTPS with a self-signed certificate made here, asks for an
API key, restricts CORS origins and runs with ``VLLM_SERVER_DEV_MODE=1`` and
``VLLM_TORCH_PROFILER_DIR``: /tokenize, /detokenize, the render endpoints,
/v1/chat/completions/batch, /invocations, /ping, /server_info, the engine's commands
(/reset_prefix_cache, /sleep, /wake_up, /is_sleeping, /start_profile, /stop_profile); the
``openai`` client over https; the flags' validation."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_served import Env, asgi, env, served_app, tokenizer  # noqa: F401
from tests.support.server_helpers import free_port, stop_process, tail

KEY = "sk-extra-endpoints"
MODEL = "tiny"
ORIGIN = "https://ok.example"
CHAT = [{"role": "user", "content": "Say hello"}]


@dataclass
class Served:
    base: str
    cert: Path
    traces: Path

    def trusting(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))

    def client(self, authorized: bool = True) -> httpx.Client:
        headers = {"Authorization": f"Bearer {KEY}"} if authorized else {}
        return httpx.Client(base_url=self.base, verify=self.trusting(), headers=headers, timeout=120)


def self_signed(directory: Path) -> tuple[Path, Path]:
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def served(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("extra")
    key, cert = self_signed(directory)
    port, log_path = free_port(), directory / "server.log"
    environ = dict(os.environ, VLLM_ACTORS_RUN_ROOT=str(directory / "runs"), VLLM_SERVER_DEV_MODE="1",
                   VLLM_TORCH_PROFILER_DIR=str(directory / "traces"))
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm_actors", "serve", str(tiny_qwen3), "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--uvicorn-log-level", "warning", "--served-model-name", MODEL,
             "--max-model-len", "256", "--num-gpu-blocks-override", "128", "--api-key", KEY,
             "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--allowed-origins", f'["{ORIGIN}"]',
             "--show-hidden-metrics-for-version", "0.25", "--enable-prompt-tokens-details"],
            stdout=log_file, stderr=subprocess.STDOUT, env=environ)
    base = f"https://127.0.0.1:{port}"
    trusting = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, tail(log_path)
            assert time.monotonic() < deadline, tail(log_path)
            try:
                if httpx.get(f"{base}/health", verify=trusting, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield Served(base, cert, directory / "traces")
        # Every client of these tests is closed when its test ends (an idle keep-alive TLS connection left
        # open held the server's stop for asyncio's 30 s TLS-close timeout until the stop dropped idle ones).
        assert not established_to(port), "a test left a connection to the server open"
    finally:
        stop_process(process)


def established_to(port: int) -> list[str]:
    """This machine's open TCP connections to 127.0.0.1:``port`` (client ends, /proc/net/tcp)."""
    remote = f"0100007F:{port:04X}"
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [row[1] for row in rows if row[2] == remote and row[3] == "01"]  # 01: ESTABLISHED


def ok(reply: httpx.Response) -> Any:
    assert reply.status_code == 200, reply.text
    return reply.json()


def error(reply: httpx.Response, status: int = 400) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()["error"]
    assert body["code"] == status
    return str(body["message"])


def test_tokenize_and_detokenize(served: Served) -> None:
    with served.client() as http:
        plain = ok(http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}))
        assert plain["count"] == len(plain["tokens"]) > 0 and plain["max_model_len"] == 256
        assert len(plain["token_strs"]) == plain["count"] and all(isinstance(s, str) for s in plain["token_strs"])
        bare = ok(http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}))
        assert bare["token_strs"] is None and bare["tokens"] == plain["tokens"][-len(bare["tokens"]):]
        assert ok(http.post("/detokenize", json={"tokens": bare["tokens"]}))["prompt"] == "Hello world"
        chat = ok(http.post("/tokenize", json={"messages": CHAT}))
        open_chat = ok(http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}))
        assert chat["count"] > open_chat["count"] and chat["tokens"][:open_chat["count"]] == open_chat["tokens"]
        assert "prompt or messages" in error(http.post("/tokenize", json={"model": MODEL}))
        assert "Cannot set both" in error(http.post("/tokenize", json={"messages": CHAT,
                                                                       "continue_final_message": True}))
        assert "out of vocabulary" in error(http.post("/detokenize", json={"tokens": [10**9]}))
        assert ">= 0" in error(http.post("/detokenize", json={"tokens": [-1]}))
        assert error(http.post("/detokenize", json={"tokens": [1], "model": "other"}), 404)


def test_render_returns_what_the_engine_would_run(served: Served) -> None:
    with served.client() as http:
        tokens = ok(http.post("/tokenize", json={"prompt": "Hello world"}))["tokens"]
        rendered = ok(http.post("/v1/completions/render", json={"model": MODEL, "prompt": "Hello world",
                                                                "max_tokens": 5, "temperature": 0}))
        assert len(rendered) == 1 and rendered[0]["token_ids"] == tokens and rendered[0]["model"] == MODEL
        assert rendered[0]["sampling_params"]["max_tokens"] == 5 and rendered[0]["sampling_params"]["temperature"] == 0
        two = ok(http.post("/v1/completions/render", json={"prompt": [[1, 2], [1, 2, 3]]}))
        assert [item["token_ids"] for item in two] == [[1, 2], [1, 2, 3]]
        assert two[0]["request_id"] != two[1]["request_id"]
        chat_tokens = ok(http.post("/tokenize", json={"messages": CHAT}))["tokens"]
        chat = ok(http.post("/v1/chat/completions/render", json={"messages": CHAT, "max_tokens": 3}))
        assert chat["token_ids"] == chat_tokens and chat["request_id"].startswith("chatcmpl-")
        assert "messages" in error(http.post("/v1/chat/completions/render", json={"messages": []}))


def test_batch_answers_each_conversation_as_chat_does(served: Served) -> None:
    greedy = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    conversations = [CHAT, [{"role": "user", "content": "Count to three"}]]
    with served.client() as http:
        singles = [ok(http.post("/v1/chat/completions", json=dict(greedy, messages=c))) for c in conversations]
        batch = ok(http.post("/v1/chat/completions/batch", json=dict(greedy, messages=conversations),
                             headers={"X-Request-Id": "b1"}))
        assert batch["id"] == "chatcmpl-b1" and batch["object"] == "chat.completion"
        assert [c["index"] for c in batch["choices"]] == [0, 1]
        assert [c["message"]["content"] for c in batch["choices"]] == \
            [s["choices"][0]["message"]["content"] for s in singles]
        assert batch["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
        assert "stream" in error(http.post("/v1/chat/completions/batch",
                                           json=dict(greedy, messages=conversations, stream=True)))
        assert "conversations" in error(http.post("/v1/chat/completions/batch", json=dict(greedy, messages=CHAT)))
        assert "max_tokens" in error(http.post("/v1/chat/completions/batch",
                                               json=dict(greedy, messages=conversations, max_tokens=10**6)))


def test_sagemaker_invocations_and_ping(served: Served) -> None:
    with served.client() as http:
        assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
        chat = ok(http.post("/invocations", json={"messages": CHAT, "max_tokens": 2}))
        assert chat["object"] == "chat.completion"
        text = ok(http.post("/invocations", json={"prompt": "Hello", "max_tokens": 2}))
        assert text["object"] == "text_completion"
        assert "Cannot find suitable handler" in error(http.post("/invocations", json={"input": "embed me"}))


def test_dev_mode_server_info(served: Served) -> None:
    with served.client() as http:
        text = ok(http.get("/server_info"))
        assert "EngineConfig(" in text["vllm_config"] and text["vllm_env"]["VLLM_SERVER_DEV_MODE"] is True
        assert "VLLM_API_KEY" not in text["vllm_env"] and "python_version" in text["system_env"]
        assert ok(http.get("/server_info", params={"config_format": "json"}))["vllm_config"]["max_model_len"] == 256
        assert "config_format" in error(http.get("/server_info", params={"config_format": "yaml"}))


def test_every_new_endpoint_wants_the_key(served: Served) -> None:
    with served.client(authorized=False) as http:
        for method, path in [("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions/render"),
                             ("POST", "/v1/chat/completions/render"), ("POST", "/v1/chat/completions/batch"),
                             ("POST", "/invocations"), ("GET", "/ping"), ("GET", "/server_info"),
                             ("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
                             ("GET", "/is_sleeping"), ("POST", "/start_profile"), ("POST", "/stop_profile")]:
            assert http.request(method, path, json={"prompt": "x"}).status_code == 401, path


def test_openai_client_over_https_and_cors(served: Served) -> None:
    with openai.OpenAI(base_url=f"{served.base}/v1", api_key=KEY,
                       http_client=httpx.Client(verify=served.trusting())) as client:
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)  # type: ignore[arg-type]
    assert reply.choices[0].message.content is not None and reply.usage is not None
    with pytest.raises(httpx.ConnectError):  # the certificate is not trusted by default
        httpx.get(f"{served.base}/health", timeout=10)
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    with served.client(authorized=False) as http:
        allowed = http.options("/v1/chat/completions", headers=preflight)  # no key: CORS answers first
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
        refused = http.options("/v1/chat/completions", headers=dict(preflight, Origin="https://evil.example"))
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_the_flags_are_validated() -> None:
    from vllm_actors.cli import build_parser
    from vllm_actors.server.http_args import check_ssl

    parser = build_parser()
    args = parser.parse_args(["serve", "m"])
    assert args.allowed_origins == ["*"] and args.ssl_keyfile is None and args.show_hidden_metrics_for_version is None
    assert parser.parse_args(["serve", "m", "--show-hidden-metrics-for-version", "0.25"]) \
        .show_hidden_metrics_for_version == "0.25"
    for bad in (["--show-hidden-metrics-for-version", "next"], ["--allowed-origins", "*"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", *bad])
    with pytest.raises(ValueError, match="go together"):
        check_ssl("key.pem", None, 0)
    with pytest.raises(ValueError, match="0, 1 or 2"):
        check_ssl(None, None, 5)


@pytest.mark.asyncio
async def test_dev_endpoints_are_absent_unless_enabled(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        assert (await http.get("/server_info")).status_code == 404
        for method, path in [("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
                             ("GET", "/is_sleeping"), ("POST", "/start_profile"), ("POST", "/stop_profile")]:
            assert (await http.request(method, path)).status_code == 404, path
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    async with served_app(env, monkeypatch) as (_, app), asgi(app) as http:
        assert (await http.get("/server_info")).status_code == 200


# ------------------------------------------------------------------ the engine's commands
LONG = "The quick brown fox jumps over the lazy dog. " * 6  # several full KV blocks


def _greedy(http: httpx.Client) -> tuple[list[int], int]:
    """Greedy tokens of ``LONG`` and how many prompt tokens the prefix cache served."""
    reply = ok(http.post("/v1/completions", json={"model": MODEL, "prompt": LONG, "max_tokens": 8, "temperature": 0,
                                                  "logprobs": 0}))
    tokens = reply["choices"][0]["logprobs"]["tokens"]
    return tokens, (reply["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_reset_prefix_cache_drops_the_hits(served: Served) -> None:
    with served.client() as http:
        assert ok(http.post("/reset_prefix_cache")) == {"success": True}
        first, cached = _greedy(http)
        assert cached == 0
        again, cached = _greedy(http)
        assert again == first and cached > 0  # the same prompt hits the cache
        assert ok(http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})) == {"success": True}
        after, cached = _greedy(http)
        assert after == first and cached == 0  # nothing to hit any more
        assert "reset_running_requests" in error(http.post("/reset_prefix_cache",
                                                           params={"reset_running_requests": "maybe"}))


def _sleep_gauge_reads(http: httpx.Client, expected: dict[str, int]) -> None:
    """vllm:engine_sleep_state's series reach ``expected`` (the scheduler's SLEEP_STATE crosses the bus
    to the metrics store on its own time)."""
    deadline = time.monotonic() + 30
    while True:
        text = http.get("/metrics").text
        series = {state: float(value) for state, value in
                  re.findall(r'^vllm:engine_sleep_state\{[^}]*sleep_state="(\w+)"\} (\S+)$', text, re.M)}
        if series == {state: float(value) for state, value in expected.items()}:
            return
        assert time.monotonic() < deadline, series
        time.sleep(0.05)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_the_greedy_tokens(served: Served, level: int) -> None:
    with served.client() as http:
        before, _ = _greedy(http)
        assert ok(http.get("/is_sleeping")) == {"is_sleeping": False}
        slept = http.post("/sleep", params={"level": str(level)})
        assert slept.status_code == 200 and slept.content == b""
        assert ok(http.get("/is_sleeping")) == {"is_sleeping": True}
        _sleep_gauge_reads(http, {"awake": 0, "weights_offloaded": int(level == 1), "discard_all": int(level == 2)})
        assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert ok(http.get("/is_sleeping")) == {"is_sleeping": True}  # the KV cache still sleeps
        assert http.post("/wake_up").status_code == 200
        assert ok(http.get("/is_sleeping")) == {"is_sleeping": False}
        _sleep_gauge_reads(http, {"awake": 1, "weights_offloaded": 0, "discard_all": 0})
        after, cached = _greedy(http)
        assert after == before and cached == 0  # the KV cache (and its prefix cache) was discarded
        assert "level" in error(http.post("/sleep", params={"level": "3"}))
        assert "tags" in error(http.post("/wake_up", params={"tags": "everything"}))


def test_a_request_sent_while_asleep_waits_for_the_wake(served: Served) -> None:
    import threading

    with served.client() as http:
        before, _ = _greedy(http)
        assert http.post("/sleep", params={"level": "1"}).status_code == 200
        result: list[list[int]] = []

        def ask() -> None:
            with served.client() as other:  # closed after: an open keep-alive connection delays the server's stop
                result.append(_greedy(other)[0])

        waiting = threading.Thread(target=ask)
        waiting.start()
        waiting.join(timeout=1.0)  # an upper bound on nothing: it must still wait, asleep
        assert not result and waiting.is_alive()
        assert http.post("/wake_up").status_code == 200
        waiting.join(timeout=120)
        assert result == [before]


def test_profiler_writes_a_trace(served: Served) -> None:
    with served.client() as http:
        assert http.post("/stop_profile").status_code == 200  # not started: nothing to write
        assert not served.traces.exists()
        assert http.post("/start_profile").status_code == 200
        _greedy(http)
        stopped = http.post("/stop_profile")
        assert stopped.status_code == 200 and stopped.content == b""
    assert list(served.traces.glob("*.json.gz")) and list(served.traces.glob("*-top.txt"))
