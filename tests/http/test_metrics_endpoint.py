"""``/metrics`` against vLLM 0.26's ``PrometheusStatLogger`` through the real
server (``vllm-actors serve`` on the tiny checkpoint, float32, CPU): every family vLLM serves by
default with its type, labels and bucket boundaries, values right for a load of known size, and
gauges that are fresh at scrape time."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_helpers import BusRecorder, free_port, start_server, stop_process, wait_healthy
from vllm_actors.observe.tap import query_metrics
from vllm_actors.protocol.metrics import TimelineQuery
from vllm_actors.runtime.run_dir import GroupInfo, read_group_info

MODEL = "tiny"
MAX_MODEL_LEN = 1024
NUM_BLOCKS = 512


@dataclass
class Served:
    base_url: str
    info: GroupInfo


@pytest.fixture(scope="module")
def served(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("metrics")
    port, log_path, run_root = free_port(), directory / "server.log", directory / "runs"
    process: subprocess.Popen[bytes] = start_server(
        tiny_qwen3, port, log_path, run_root, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
        "--num-gpu-blocks-override", str(NUM_BLOCKS))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log_path)
        (run_dir,) = [path.parent for path in run_root.glob("*/group.json")]
        yield Served(url, read_group_info(run_dir))
    finally:
        stop_process(process)


Sample = tuple[str, frozenset[tuple[str, str]]]  # a sample's name and labels


def scrape(served: Served) -> dict[Sample, float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in families(served).values() for sample in family.samples}


def sample(name: str, **labels: str) -> Sample:
    return name, frozenset({"model_name": MODEL, "engine": "0", **labels}.items())


def families(served: Served) -> dict[str, Metric]:
    text = httpx.get(f"{served.base_url}/metrics").text
    return {family.name: family for family in text_string_to_metric_families(text)}


# vLLM 0.26.0, vllm/v1/metrics/loggers.py, PrometheusStatLogger: every family it serves by default
# (no speculative decoding, LoRA, KV connector, --kv-cache-metrics or VLLM_COMPUTE_NANS_IN_LOGITS),
# with its type, its labels beyond model_name and engine, and its buckets.
def build_1_2_5(max_value: int) -> list[float]:
    return [m * 10**e for e in range(10) for m in (1, 2, 5) if m * 10**e <= max_value]


TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TOKENS = build_1_2_5(MAX_MODEL_LEN)
VLLM_FAMILIES: dict[str, tuple[str, tuple[str, ...], list[float] | None]] = {
    "vllm:num_requests_running": ("gauge", (), None),
    "vllm:num_requests_waiting": ("gauge", (), None),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",), None),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",), None),
    "vllm:kv_cache_usage_perc": ("gauge", (), None),
    "vllm:prefix_cache_queries": ("counter", (), None),
    "vllm:prefix_cache_hits": ("counter", (), None),
    "vllm:external_prefix_cache_queries": ("counter", (), None),
    "vllm:external_prefix_cache_hits": ("counter", (), None),
    "vllm:mm_cache_queries": ("counter", (), None),
    "vllm:mm_cache_hits": ("counter", (), None),
    "vllm:num_preemptions": ("counter", (), None),
    "vllm:prompt_tokens": ("counter", (), None),
    "vllm:prompt_tokens_by_source": ("counter", ("source",), None),
    "vllm:prompt_tokens_cached": ("counter", (), None),
    "vllm:generation_tokens": ("counter", (), None),
    "vllm:request_success": ("counter", ("finished_reason",), None),
    "vllm:request_prompt_tokens": ("histogram", (), TOKENS),
    "vllm:request_generation_tokens": ("histogram", (), TOKENS),
    "vllm:iteration_tokens_total": ("histogram", (), [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                      16384]),
    "vllm:request_max_num_generation_tokens": ("histogram", (), TOKENS),
    "vllm:request_params_n": ("histogram", (), [1, 2, 5, 10, 20]),
    "vllm:request_params_max_tokens": ("histogram", (), TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", (), TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", (), ITL),
    "vllm:request_time_per_output_token_seconds": ("histogram", (), ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", (), LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", (), TOKENS),
}
LABEL_VALUES = {"reason": {"capacity", "deferred"}, "sleep_state": {"awake", "weights_offloaded", "discard_all"},
                "source": {"local_compute", "local_cache_hit", "external_kv_transfer"},
                "finished_reason": {"stop", "length", "abort", "error", "repetition"}}


def check_family(family: Metric, kind: str, extra: tuple[str, ...], buckets: list[float] | None) -> None:
    assert family.type == kind, (family.name, family.type)
    samples = [s for s in family.samples if not s.name.endswith("_created")]
    assert samples, family.name
    for sample in samples:
        labels = dict(sample.labels)
        assert labels.pop("model_name") == MODEL and labels.pop("engine") == "0", (family.name, sample.labels)
        if kind == "histogram" and sample.name.endswith("_bucket"):
            labels.pop("le")
        assert set(labels) == set(extra), (family.name, sample.labels)
    for label in extra:
        assert {dict(s.labels)[label] for s in samples} == LABEL_VALUES[label], (family.name, label)
    if buckets is not None:
        bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")]
        assert bounds == [*map(float, buckets), float("inf")], family.name


def test_vllm_families_with_vllms_types_labels_buckets_and_values(served: Served) -> None:
    """Three requests of known size (one finding its prompt's first block cached, one with n = 2):
    every family vLLM serves, as vLLM serves it, and the values each request adds."""
    before = scrape(served)
    prompt = list(range(5, 25))  # 20 tokens: the second request finds its first block of 16 cached
    for body in ({"prompt": prompt, "max_tokens": 5}, {"prompt": prompt, "max_tokens": 5},
                 {"prompt": list(range(30, 37)), "max_tokens": 3, "n": 2}):
        reply = httpx.post(f"{served.base_url}/v1/completions", timeout=120,
                           json={"model": MODEL, "ignore_eos": True, "temperature": 0, **body})
        assert reply.status_code == 200, reply.text
    after = scrape(served)
    found = families(served)
    for name, (kind, extra, buckets) in VLLM_FAMILIES.items():
        assert name in found, name
        check_family(found[name], kind, extra, buckets)
    info = found["vllm:cache_config_info"]
    assert info.type == "gauge" and len(info.samples) == 1 and info.samples[0].value == 1.0
    assert {"engine": "0", "num_gpu_blocks": str(NUM_BLOCKS), "block_size": "16",
            "enable_prefix_caching": "True"}.items() <= info.samples[0].labels.items()

    def grew(name: str, **labels: str) -> float:
        key = sample(name, **labels)
        return after[key] - before.get(key, 0.0)

    # per engine request (the n = 2 request is two): prompts 20, 20, 7, 7; generated 5, 5, 3, 3
    assert (grew("vllm:request_prompt_tokens_count"), grew("vllm:request_prompt_tokens_sum")) == (4, 54)
    assert (grew("vllm:request_generation_tokens_count"), grew("vllm:request_generation_tokens_sum")) == (4, 16)
    assert (grew("vllm:request_params_max_tokens_count"), grew("vllm:request_params_max_tokens_sum")) == (4, 16)
    assert grew("vllm:request_prefill_kv_computed_tokens_sum") == 20 + (20 - 16) + 7 + 7
    # per request: n and its longest child
    assert (grew("vllm:request_params_n_count"), grew("vllm:request_params_n_sum")) == (3, 4)
    assert grew("vllm:request_max_num_generation_tokens_sum") == 5 + 5 + 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert grew(f"vllm:{name}_count") == 4, name
    # The queue time comes from the scheduler's events on the bus, a hop longer than the outputs: a
    # short request can finish before its SCHEDULED event arrives, which still counts when it does.
    queue = sample("vllm:request_queue_time_seconds_count")
    deadline = time.monotonic() + 60  # a safety net: the event comes in milliseconds
    while after[queue] - before.get(queue, 0.0) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
        after[queue] = scrape(served)[queue]
    assert after[queue] - before.get(queue, 0.0) == 4
    assert grew("vllm:inter_token_latency_seconds_count") > 0
    # the group's counters, from the metrics store
    assert grew("vllm:prompt_tokens_total") == 54 and grew("vllm:generation_tokens_total") == 16
    assert grew("vllm:prompt_tokens_cached_total") == 16
    assert grew("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 16
    assert grew("vllm:prompt_tokens_by_source_total", source="local_compute") == 54 - 16
    assert grew("vllm:request_success_total", finished_reason="length") == 4
    # as vLLM: every sampling step's tokens (first ones included), plus the uncached prompt tokens
    # of the requests whose first token it sampled
    assert grew("vllm:iteration_tokens_total_sum") == (54 - 16) + 16
    assert grew("vllm:iteration_tokens_total_count") >= 5 + 5 + 3  # the requests ran one after another


def wait_for_next_batch(recorder: BusRecorder, timeout: float = 60.0) -> None:
    """Until one more event batch is on the bus (``timeout``: a safety net only)."""
    with recorder._arrived:
        seen = len(recorder.batches)
        assert recorder._arrived.wait_for(lambda: len(recorder.batches) > seen, timeout)


def test_gauges_are_fresh_at_scrape_time(served: Served) -> None:
    """Three long requests running: as soon as the metrics store has seen each one's first token
    (its own timeline says so: no waiting on time), a scrape shows them running and their KV blocks."""
    recorder = BusRecorder(served.info.addresses.bus_out, bus_in=served.info.addresses.bus_in)
    stop = threading.Event()
    ids = [f"fresh{i}" for i in range(3)]

    def run(request_id: str) -> None:
        body = {"model": MODEL, "prompt": f"Request {request_id} says", "max_tokens": MAX_MODEL_LEN - 32,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=served.base_url, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": request_id}) as reply:
                for _ in reply.iter_lines():
                    if stop.is_set():
                        return  # leaving hangs up: the request is aborted

    threads = [threading.Thread(target=run, args=(request_id,), daemon=True) for request_id in ids]
    try:
        for thread in threads:
            thread.start()
        engine_ids = [f"cmpl-{request_id}-0" for request_id in ids]
        for engine_id in engine_ids:
            recorder.wait_for("FIRST_TOKEN", engine_id)
            while True:  # the store applies the bus's events in its own time: wait until it has this one
                timeline = query_metrics(served.info.addresses.metrics, TimelineQuery(request_id=engine_id))
                if any(entry.type == "FIRST_TOKEN" for entry in timeline.events):
                    break
                wait_for_next_batch(recorder)  # the next step's events, at most, before looking again
        values = scrape(served)
        assert not any(recorder.events("FINISHED", engine_id) for engine_id in engine_ids), "finished too early"
        assert values[sample("vllm:num_requests_running")] >= 3
        assert values[sample("vllm:kv_cache_usage_perc")] > 0.0
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        recorder.close()


def stream_chunks(served: Served, endpoint: str, body: dict[str, object]) -> list[dict[str, object]]:
    chunks = []
    with httpx.Client(base_url=served.base_url, timeout=120) as client:
        with client.stream("POST", f"/v1/{endpoint}", json={"model": MODEL, "stream": True, **body}) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_continuous_usage_stats_on_every_chunk_count_the_chunks_choice(served: Served, endpoint: str) -> None:
    """``continuous_usage_stats``: usage on every chunk (the chat role chunk included: it said
    ``usage: null``), with vLLM's counts: the prompt, and the tokens of that chunk's choice so far."""
    prompt = {"messages": [{"role": "user", "content": "Hi"}]} if endpoint.startswith("chat") else {"prompt": "Hi"}
    chunks = stream_chunks(served, endpoint, {
        **prompt, "max_tokens": 3, "n": 2, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *with_choices, last = chunks
    assert not last["choices"] and last["usage"]["completion_tokens"] == 6
    prompt_tokens = last["usage"]["prompt_tokens"]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for chunk in with_choices:
        usage = chunk["usage"]
        assert isinstance(usage, dict), chunk  # never null, never missing
        (choice,) = chunk["choices"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        seen[choice["index"]].append(usage["completion_tokens"])
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 3, seen  # each choice's own tokens, not the sum
    if endpoint.startswith("chat"):
        assert with_choices[0]["choices"][0]["delta"]["role"] == "assistant"
        assert with_choices[0]["usage"]["completion_tokens"] == 0


def test_where_a_tokens_way_to_the_client_is_spent(served: Served) -> None:
    """This engine's own histograms: vllm_actors:output_transit_seconds (a step's result leaving
    the worker to its outputs reaching the server, one sample per frame: every step of a streamed
    request brings one) and vllm_actors:stream_wait_seconds (an output waiting in the server before
    its response took it). The stamps share the host's monotonic clock, so the times are small and
    positive."""
    before = scrape(served)
    body = {"model": MODEL, "prompt": list(range(40, 52)), "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        chunks = [line for line in reply.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 1
    after = scrape(served)

    def grew(name: str) -> float:
        return after[sample(name)] - before.get(sample(name), 0.0)

    frames = grew("vllm_actors:output_transit_seconds_count")
    assert frames >= 6  # one frame per step that gave this request a token
    assert 0 < grew("vllm_actors:output_transit_seconds_sum") < 60 * frames
    waits = grew("vllm_actors:stream_wait_seconds_count")
    assert 1 <= waits <= 6 + 1  # one per output taken (outputs coalesce when the response lags)
    assert 0 <= grew("vllm_actors:stream_wait_seconds_sum") < 60 * waits
