"""The online benchmark's client (bench/serve_client.py) against a fake SSE server: streaming,
chunked and unchunked bodies, failures, token counts, TTFT / ITL and the SLO goodput."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from vllm_actors.bench.serve import format_row
from vllm_actors.bench.serve_client import (
    RequestResult,
    ServeRequest,
    make_requests,
    poisson_requests,
    run_load,
    split_load,
    summarize,
    tpot,
)

FAIL_TOKENS = 13  # a request for this many tokens gets HTTP 500
SLOW_TOKENS = 7  # ... its first token after SLOW_FIRST_S
SLOW_FIRST_S = 0.3
GAP_S = 0.005


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    headers = {}
    await reader.readline()
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = json.loads(await reader.readexactly(int(headers["content-length"])))
    assert body["stream"] and body["ignore_eos"] and body["model"] == "fake"
    n = int(body["max_tokens"])
    if n == FAIL_TOKENS:
        message = b'{"error": "boom"}'
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s" % (len(message), message))
        await writer.drain()
        writer.close()
        return
    chunked = body["prompt"][0] % 2 == 0  # odd first token id: a body that ends when the connection closes
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 + (b"Transfer-Encoding: chunked\r\n" if chunked else b"Connection: close\r\n") + b"\r\n")

    async def send(event: dict | str) -> None:
        data = ("data: " + (event if isinstance(event, str) else json.dumps(event)) + "\r\n\r\n").encode()
        if chunked:
            half = len(data) // 2  # events split across transfer chunks
            for piece in (data[:half], data[half:]):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        else:
            writer.write(data)
        await writer.drain()

    await asyncio.sleep(SLOW_FIRST_S if n == SLOW_TOKENS else 0.0)
    for index in range(n):
        if index:
            await asyncio.sleep(GAP_S)
        await send({"choices": [{"index": 0, "text": f" t{index}", "finish_reason": "length" if index == n - 1
                                 else None}]})
    await send({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
    await send("[DONE]")
    if chunked:
        writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


@pytest.fixture
def fake_server() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        server = await asyncio.start_server(_handle, "127.0.0.1", 0)
        holder["port"] = server.sockets[0].getsockname()[1]
        holder["server"] = server
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{holder['port']}/v1/completions"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _requests() -> list[ServeRequest]:
    sizes = [5, 9, FAIL_TOKENS, SLOW_TOKENS, 3, 12]
    return [ServeRequest(index, [index + 1] * 4, size, offset=0.01 * index) for index, size in enumerate(sizes)]


def test_open_loop_against_fake_server(fake_server: str) -> None:
    requests = _requests()
    results, start = run_load(split_load(fake_server, "fake", requests, 2, temperature=0.0, timeout=10),
                              in_process=True)
    assert [r.index for r in results] == list(range(len(requests)))
    by_tokens = {r.max_tokens: r for r in results}
    failed = by_tokens[FAIL_TOKENS]
    assert not failed.ok and failed.error.startswith("HttpError: HTTP 500")
    for r in results:
        if r.max_tokens == FAIL_TOKENS:
            continue
        assert r.ok, r.error
        assert r.output_tokens == r.chunks == r.max_tokens
        assert len(r.itl) == r.max_tokens - 1
        assert sum(r.itl) >= (r.max_tokens - 1) * GAP_S * 0.8  # the server sleeps between tokens
        assert r.e2e >= r.ttft + sum(r.itl) - 1e-6
    assert by_tokens[SLOW_TOKENS].ttft >= SLOW_FIRST_S * 0.9
    # sent at their offsets: never before (how late a loaded machine sends one is not this test's business;
    # comparing two requests' send times failed when the first went out late)
    assert all(r.start >= start + requests[r.index].offset - 1e-6 for r in results)

    summary = summarize(results, start, ttft_slo=0.2, itl_slo=0.05)
    assert summary["requests"] == 6 and summary["failed"] == 1 and summary["completed"] == 5
    assert summary["errors"] == {"HttpError": 1}
    assert summary["output_tokens"] == 5 + 9 + SLOW_TOKENS + 3 + 12
    assert summary["goodput"]["good"] == 4  # all but the failed and the slow one
    assert summary["ttft"]["count"] == 5 and summary["itl"]["count"] == 4 + 8 + 6 + 2 + 11
    assert summary["ttft"]["p99"] >= SLOW_FIRST_S * 0.9
    assert summary["tokens_per_chunk"] == 1.0 and summary["tpot"]["count"] == 5
    assert summary["tpot"]["p50"] >= GAP_S * 0.8
    summary.update({"kind": "rate", "value": 2.0, "sent": 6})
    assert format_row("fake", summary).startswith("| fake | 2/s | 6 | 1 |")


def test_closed_loop_in_client_processes(fake_server: str) -> None:
    requests = make_requests(40, seed=3, input_range=(4, 8), output_range=(2, 4))
    shards = split_load(fake_server, "fake", requests, 2, temperature=0.0, timeout=10, concurrency=3, duration=0.3)
    assert [shard.workers for shard in shards] == [2, 1]
    results, start = run_load(shards)
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(r.start < start + 0.3 + 0.05 for r in results)  # no new request after the duration
    assert sum(r.output_tokens for r in results) == sum(r.max_tokens for r in results)


def test_workload_and_slo() -> None:
    requests = poisson_requests(20.0, 30.0, seed=1)
    assert requests == poisson_requests(20.0, 30.0, seed=1)
    assert all(0 < r.offset <= 30.0 for r in requests)
    assert 500 < len(requests) < 700
    assert all(128 <= len(r.prompt) <= 1024 and 64 <= r.max_tokens <= 512 for r in requests)
    lengths = sorted(len(r.prompt) for r in requests)
    assert 200 < lengths[len(lengths) // 2] < 450  # a ShareGPT-like median, not the range's middle

    good = RequestResult(0, 10, 3, ok=True, ttft=0.1, itl=[0.01] * 99 + [0.2])  # p99 of its gaps: ~0.012
    assert good.meets(0.2, 0.05)
    assert not RequestResult(0, 10, 3, ok=True, ttft=0.1, itl=[0.01] * 50 + [0.2] * 5).meets(0.2, 0.05)
    assert not RequestResult(0, 10, 3, ok=True, ttft=0.25).meets(0.2, 0.05)
    assert not RequestResult(0, 10, 3, ok=False, ttft=0.01).meets(0.2, 0.05)
    assert tpot(0.1, 1.1, 11) == pytest.approx(0.1) and tpot(0.1, 0.1, 1) is None


def test_command_line() -> None:
    from vllm_actors.bench.serve import build_parser, server_command
    from vllm_actors.cli import build_parser as cli_parser
    from vllm_actors.cli import engine_kwargs

    cli = cli_parser()
    assert engine_kwargs(cli.parse_args(["serve", "m", "--load-format", "dummy"]))["load_format"] == "dummy"
    assert engine_kwargs(cli.parse_args(["serve", "m"]))["load_format"] == "auto"
    assert cli.parse_args(["bench", "serve", "--rates", "1"]).which == "serve"
    args = build_parser().parse_args(["--engines", "ours", "vllm", "--rates", "0.5", "20", "--port", "9"])
    ours, vllm = (server_command(engine, args, "/m", "dummy") for engine in ("ours", "vllm"))
    assert ours[1:4] == ["-m", "vllm_actors", "serve"] and vllm[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert ours[4:] == vllm[4:] and "--load-format" in ours and ours[ours.index("--port") + 1] == "9"
    args = build_parser().parse_args(["--engines", "sglang", "--port", "9", "--max-model-len", "8192"])
    sglang = server_command("sglang", args, "/m", "dummy")
    assert sglang[1:3] == ["-m", "sglang.launch_server"] and sglang[sglang.index("--model-path") + 1] == "/m"
    assert sglang[sglang.index("--context-length") + 1] == "8192" and sglang[sglang.index("--port") + 1] == "9"
    assert sglang[-4:] == ["--log-level", "warning", "--attention-backend", "fa3"]
    assert "--max-num-seqs" not in sglang  # SGLang at its own defaults for batch size and memory


_FAKE_VLLM = '''
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, **kw): self.kw = kw
class _Completion:
    def __init__(self, n): self.token_ids = list(range(n))
class _Output:
    def __init__(self, n): self.outputs = [_Completion(n)]
class LLM:
    def __init__(self, **kw): assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"]
    def generate(self, inputs, params, use_tqdm=False):
        assert all("prompt_token_ids" in i for i in inputs) and all(p.kw["ignore_eos"] for p in params)
        return [_Output(p.kw["max_tokens"]) for p in params]
'''


def test_vllm_peer_runs_in_its_own_process(tmp_path: Path) -> None:
    """throughput --peer vllm: peer_vllm.py under another PYTHONPATH (here a stand-in for vLLM)."""
    from benchmarks.lib.throughput_compare import build_parser, run_vllm_peer

    from vllm_actors.bench.throughput_workload import make_workload

    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(_FAKE_VLLM)
    args = build_parser().parse_args(["--peer", "vllm", "--vllm-pythonpath", str(site.parent), "--runs", "2",
                                      "--batch1-input-len", "8", "--batch1-output-len", "5",
                                      "--out", str(tmp_path / "out")])
    Path(args.out).mkdir()
    workload = make_workload(3, max_input_len=16, max_output_len=4)
    result = run_vllm_peer(args, str(tmp_path), "dummy", workload, tmp_path, 151936)
    assert "error" not in result, result.get("error")
    assert result["version"] == "0.0-fake" and len(result["runs"]) == 2
    assert result["output_tokens"] == result["expected_output_tokens"] == workload.output_tokens
    assert result["batch1"]["input_len"] == 8 and len(result["batch1"]["ttft_samples_s"]) == 5
    (site / "__init__.py").write_text("raise ImportError('no vllm here')")
    failed = run_vllm_peer(args, str(tmp_path), "dummy", workload, tmp_path / "out", 151936)
    assert failed["error"].startswith("exit 1") and "no vllm here" in failed["error"]


_FAKE_SGLANG = '''
__version__ = "0.0-fake"
class _Args:
    def __init__(self, kw): self.__dict__.update(kw, chunked_prefill_size=8192, _hidden=object())
class Engine:
    def __init__(self, **kw):
        assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] and kw["sampling_backend"] == "pytorch"
        assert kw["attention_backend"] == "fa3" and not kw["disable_radix_cache"] and kw["port"] > 0
        self.server_args = _Args(kw)
    def generate(self, input_ids, sampling_params):
        assert all(p["ignore_eos"] and p["temperature"] == 0.6 for p in sampling_params)
        return [{"output_ids": [0] * p["max_new_tokens"], "meta_info": {"completion_tokens": p["max_new_tokens"]}}
                for p in sampling_params]
    def shutdown(self): pass
'''


def test_sglang_peer_runs_in_its_own_process(tmp_path: Path) -> None:
    """throughput --peer sglang: peer_sglang.py under SGLang's PYTHONPATH (here a stand-in), with its
    resolved server arguments in the result."""
    from benchmarks.lib.throughput_compare import build_parser, run_engine_peer

    from vllm_actors.bench.throughput_workload import make_workload

    site = tmp_path / "site" / "sglang"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(_FAKE_SGLANG)
    args = build_parser().parse_args(["--peer", "sglang", "--sglang-pythonpath", str(site.parent), "--runs", "1",
                                      "--batch1-input-len", "8", "--batch1-output-len", "5",
                                      "--out", str(tmp_path / "out")])
    Path(args.out).mkdir()
    workload = make_workload(3, max_input_len=16, max_output_len=4)
    result = run_engine_peer("sglang", args, str(tmp_path), "dummy", workload, tmp_path, 151936)
    assert "error" not in result, result.get("error")
    assert result["engine"] == "sglang" and result["version"] == "0.0-fake" and len(result["runs"]) == 1
    assert result["output_tokens"] == result["expected_output_tokens"] == workload.output_tokens
    assert result["settings"]["chunked_prefill_size"] == 8192 and result["settings"]["context_length"] == 4096
    assert "_hidden" not in result["server_args"] and result["batch1"]["output_len"] == 5
    assert (Path(args.out) / "sglang_peer.log").is_file()


def test_sglang_sampling_parameters_carry_the_mix() -> None:
    from benchmarks.lib.peer_sglang import output_tokens, sampling_params

    assert sampling_params(5, {"json": "{}", "presence_penalty": 0.5}) == {
        "temperature": 0.6, "max_new_tokens": 5, "ignore_eos": True, "json_schema": "{}", "presence_penalty": 0.5}
    assert output_tokens({"output_ids": [1, 2, 3]}) == 3
    assert output_tokens({"output_ids": [1], "meta_info": {"completion_tokens": 4}}) == 4


def test_server_delays_are_the_loads_difference_with_bucket_bounds() -> None:
    """bench/serve_delays.py: a load's samples are after minus before; its quantiles are the upper
    bounds of the buckets that reach the share."""
    from vllm_actors.bench.serve_delays import describe, difference

    before = {"transit": {"buckets": {0.001: 10.0, 0.01: 10.0, float("inf"): 10.0}, "count": 10.0, "sum": 0.005}}
    after = {"transit": {"buckets": {0.001: 10.0, 0.01: 108.0, float("inf"): 110.0}, "count": 110.0, "sum": 0.6},
             "stream_wait": {"buckets": {0.001: 0.0, float("inf"): 0.0}, "count": 0.0, "sum": 0.0}}
    delays = difference(before, after)
    assert set(delays) == {"transit"}  # nothing new in stream_wait
    row = delays["transit"]
    assert row["count"] == 100 and abs(row["mean"] - 0.00595) < 1e-12
    assert (row["p50"], row["p90"], row["p99"]) == (0.01, 0.01, float("inf"))  # 98 of 100 within 10 ms
    assert "transit mean 5.95 ms" in describe(delays)
    assert difference(before, None) == {}
