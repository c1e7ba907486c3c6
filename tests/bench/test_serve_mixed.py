"""The online benchmark's mixed workload (bench/serve_mixed.py, serve_policies.py): a deterministic
bursty stream of interactive and batch requests, SLO attainment per class against a hand-computed
example, and a short run of ``bench serve --workload mixed`` against a tiny model, once per policy."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.support.trace_check import check_schema
from vllm_actors.bench.serve_client import RequestResult
from vllm_actors.bench.serve_mixed import (
    BATCH,
    INTERACTIVE,
    MixedRequest,
    MixedWorkload,
    RequestClass,
    attainment,
    meets,
    mixed_requests,
)


def test_the_workload_is_deterministic_with_both_classes_and_bursts() -> None:
    # Determinism on 40 s of arrivals (~800 requests: the same code as 400 s, a tenth of the draws).
    short = mixed_requests(MixedWorkload(rate=20.0, duration=40.0, seed=5))
    assert short == mixed_requests(MixedWorkload(rate=20.0, duration=40.0, seed=5))
    assert short != mixed_requests(MixedWorkload(rate=20.0, duration=40.0, seed=6))
    # The shape on 400 s (~8,000 requests), enough for the rates and shares to hold within their tolerances.
    workload = MixedWorkload(rate=20.0, duration=400.0, seed=5)
    requests = mixed_requests(workload)
    assert [r.index for r in requests] == list(range(len(requests)))
    offsets = [r.offset for r in requests]
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] <= 400.0
    assert len(requests) == pytest.approx(20.0 * 400.0, rel=0.05)  # the mean rate is kept
    # bursts: 2 s on at 3x the mean, 6 s off at 1/3 of it
    assert workload.rates() == pytest.approx((60.0, 20.0 / 3))
    in_burst = [r for r in requests if r.burst]
    assert all(r.offset % 8.0 < 2.0 for r in in_burst) and all(r.offset % 8.0 >= 2.0 for r in requests
                                                               if not r.burst)
    assert len(in_burst) / (400.0 / 8 * 2) == pytest.approx(60.0, rel=0.06)
    assert (len(requests) - len(in_burst)) / (400.0 / 8 * 6) == pytest.approx(20.0 / 3, rel=0.06)
    # classes: 80% interactive, each within its own lengths, carrying its fields
    interactive = [r for r in requests if r.klass == "interactive"]
    batch = [r for r in requests if r.klass == "batch"]
    assert len(interactive) / len(requests) == pytest.approx(0.8, abs=0.02) and len(batch) + len(interactive) == len(
        requests)
    for group, klass in ((interactive, INTERACTIVE), (batch, BATCH)):
        assert all(klass.input_range[0] <= len(r.prompt) <= klass.input_range[1] for r in group)
        assert all(klass.output_range[0] <= r.max_tokens <= klass.output_range[1] for r in group)
    assert interactive[0].extra == {"priority": 0, "ttft_target_ms": 200.0,
                                    "e2e_target_ms": 200.0 + interactive[0].max_tokens * 50.0}
    assert batch[0].extra == {"priority": 1, "ttft_target_ms": 10_000.0, "e2e_target_ms": 120_000.0}
    plain = mixed_requests(MixedWorkload(rate=5.0, duration=20.0, seed=1, send_fields=False))
    assert all(r.extra == {} for r in plain)
    unset = RequestClass("x", (1, 2), (1, 2))  # no targets, no priority: no fields sent
    assert all(r.extra == {} for r in mixed_requests(MixedWorkload(rate=5.0, duration=5.0, seed=1,
                                                                   classes=(unset, unset))))
    with pytest.raises(ValueError, match="burst factor"):
        MixedWorkload(rate=1.0, duration=1.0, seed=0, burst_factor=5.0).rates()


def test_attainment_by_hand() -> None:
    inter = RequestClass("interactive", (1, 10), (1, 10), ttft_ms=200.0, itl_ms=50.0, priority=0)
    batch = RequestClass("batch", (1, 10), (1, 10), ttft_ms=1000.0, e2e_ms=5000.0, priority=1)
    requests = [
        MixedRequest(0, [1], 4, 0.0, klass="interactive", burst=True),
        MixedRequest(1, [1], 4, 0.1, klass="interactive", burst=False),
        MixedRequest(2, [1], 4, 0.2, klass="interactive", burst=True),
        MixedRequest(3, [1], 4, 0.3, klass="interactive", burst=False),
        MixedRequest(4, [1], 100, 0.4, klass="batch", burst=True),
        MixedRequest(5, [1], 100, 0.5, klass="batch", burst=False),
        MixedRequest(6, [1], 100, 0.6, klass="batch", burst=False),
    ]
    results = [
        # met: TTFT 150 ms, gaps 40 ms, end 0.27 s (target 200 + 4 x 50 = 400 ms)
        RequestResult(0, 1, 4, start=10.0, ok=True, ttft=0.15, e2e=0.27, output_tokens=4, itl=[0.04] * 3),
        # TTFT 250 ms > 200: missed
        RequestResult(1, 1, 4, start=10.1, ok=True, ttft=0.25, e2e=0.3, output_tokens=4, itl=[0.01] * 3),
        # p99 gap 60 ms > 50: missed
        RequestResult(2, 1, 4, start=10.2, ok=True, ttft=0.1, e2e=0.3, output_tokens=4, itl=[0.01, 0.06, 0.01]),
        # rejected at admission
        RequestResult(3, 1, 4, start=10.3, error="HttpError: HTTP 503: deadline cannot be met"),
        # batch: met (TTFT 0.9 s, e2e 4 s)
        RequestResult(4, 1, 100, start=10.4, ok=True, ttft=0.9, e2e=4.0, output_tokens=100, itl=[0.03] * 99),
        # batch: e2e 6 s > 5: missed (but its tokens count)
        RequestResult(5, 1, 100, start=10.5, ok=True, ttft=0.5, e2e=6.0, output_tokens=100, itl=[0.05] * 99),
        # batch: failed otherwise
        RequestResult(6, 1, 100, start=10.6, error="HttpError: HTTP 500: boom"),
    ]
    assert [meets(r, inter if q.klass == "interactive" else batch, q.max_tokens)
            for r, q in zip(results, requests)] == [True, False, False, False, True, False, False]
    figures = attainment(results, requests, (inter, batch), start=10.0)
    assert figures["wall_s"] == pytest.approx(6.5)  # first send (10.0) to the last end (10.5 + 6)
    i, b = figures["classes"]["interactive"], figures["classes"]["batch"]
    assert (i["requests"], i["completed"], i["rejected"], i["failed"], i["met"]) == (4, 3, 1, 0, 1)
    assert i["attainment"] == 0.25
    assert (b["requests"], b["completed"], b["rejected"], b["failed"], b["met"]) == (3, 2, 0, 1, 1)
    assert b["attainment"] == pytest.approx(1 / 3)
    assert b["output_tokens"] == 200 and b["output_tok_s"] == pytest.approx(200 / 6.5)
    assert i["ttft"]["count"] == 3 and i["ttft"]["max"] == pytest.approx(0.25)
    bursts = figures["in_bursts"]
    assert (bursts["interactive"]["requests"], bursts["interactive"]["met"]) == (2, 1)
    assert (bursts["batch"]["requests"], bursts["batch"]["met"]) == (1, 1)
    assert figures["targets"]["interactive"] == {"ttft_ms": 200.0, "itl_p99_ms": 50.0, "e2e_ms": None,
                                                 "priority": 0}


TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "float32",
    "vocab_size": 10240, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "attention_bias": False, "eos_token_id": 0,
}


@pytest.mark.slow
def test_mixed_run_against_a_tiny_model_once_per_policy(tmp_path: Path) -> None:
    from vllm_actors.bench.serve import main, write_model_dir

    model = write_model_dir(tmp_path / "tiny", TINY_CONFIG)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "out"
    # Policies both before and after priority/EDF/LRS exist; a priority other than 0 is refused
    # (400) by a server without priority scheduling, so both classes send 0 here.
    status = main([
        "--model", str(model), "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "256",
        "--max-num-seqs", "16", "--port", str(port), "--server-timeout", "300",
        "--server-args", "--num-gpu-blocks-override 128",  # a pool sized to the load, not to the host's memory
        "--workload", "mixed", "--scheduling-policies", "fcfs", "lpm", "--rates", "6", "--duration", "2",
        "--num-clients", "1", "--warmup-requests", "0", "--temperature", "0",
        "--interactive-input-len", "4", "16", "--interactive-output-len", "2", "6",
        "--batch-input-len", "32", "64", "--batch-output-len", "8", "16", "--batch-priority", "0",
        "--burst-on-s", "0.5", "--burst-off-s", "1.5", "--seed", "3",
        "--trace", str(out / "trace.json.gz"), "--trace-policies", "lpm", "--out", str(out),
    ])
    report = json.loads((out / "serve.json").read_text())
    servers = report["servers"]
    assert [s["name"] for s in servers] == ["vllm_actors fcfs", "vllm_actors lpm"], [s.get("error") for s in servers]
    assert status == 0, [s.get("error") for s in servers]
    sent = None
    for server in servers:
        assert server["command"].endswith(f"--scheduling-policy {server['policy']}")
        (load,) = server["loads"]
        slo = load["slo"]
        classes = slo["classes"]
        assert set(classes) == {"interactive", "batch"}
        total = sum(entry["requests"] for entry in classes.values())
        assert total == load["sent"] == len(load["per_request"])
        sent = total if sent is None else sent
        assert total == sent  # the same requests for every policy
        for entry in classes.values():
            assert entry["completed"] + entry["rejected"] == entry["requests"]  # nothing failed otherwise
            assert 0.0 <= entry["attainment"] <= 1.0 and entry["met"] <= entry["completed"]
        assert {row["class"] for row in load["per_request"]} <= {"interactive", "batch"}
        cpu = load["server_cpu"]  # cores each role of the started server used over the load
        assert {"api", "scheduler", "worker", "kv_cache_manager", "bus", "metrics"} <= set(cpu), cpu
        assert all(cores >= 0.0 for cores in cpu.values()) and cpu["worker"] > 0.0
    assert "trace" not in servers[0] and servers[1]["trace"]["path"] == str(out / "trace-lpm.json.gz")
    import gzip

    trace = json.loads(gzip.decompress((out / "trace-lpm.json.gz").read_bytes()))
    events = check_schema(trace)
    assert sum(1 for e in events if e["name"] == "finished") >= sent
    table = (out / "serve.md").read_text()
    assert "SLO attainment" in table and "| vllm_actors lpm | 6/s |" in table
    assert "Mixed workload: 80% interactive; bursts of 3x the mean rate for 0.5 s every 2 s" in table
    assert "FCFS meets fewer than 80% of interactive deadlines from" in table


def test_servers_per_policy_and_their_trace_files() -> None:
    from vllm_actors.bench.serve import build_parser
    from vllm_actors.bench.serve_policies import check_arguments, servers, trace_env, trace_path

    parse = build_parser().parse_args
    args = parse(["--workload", "mixed", "--scheduling-policies", "fcfs", "edf", "--engines", "ours", "vllm",
                  "--trace", "/t/trace.json.gz", "--trace-policies", "edf"])
    check_arguments(args)
    assert servers(args) == [("ours", "fcfs"), ("ours", "edf"), ("vllm", None)]
    assert trace_path(args, "ours", "fcfs", True) is None
    assert trace_path(args, "ours", "edf", True) == Path("/t/trace-edf.json.gz")
    assert trace_path(args, "vllm", None, True) is None  # only our servers have a metrics store
    assert trace_path(parse(["--trace", "/t/x.json"]), "ours", None, False) == Path("/t/x.json")
    assert trace_path(parse(["--trace", "/t/x.json"]), "ours", None, True) == Path("/t/x-ours.json")
    assert servers(parse(["--engines", "vllm", "ours"])) == [("vllm", None), ("ours", None)]
    assert trace_env(args)["VLLM_ACTORS_METRICS_MAX_EVENTS"] == "200000"
    for bad in (["--workload", "mixed", "--concurrencies", "4"], ["--scheduling-policies", "fcfs", "--url", "http://x"],
                ["--workload", "mixed", "--burst-factor", "9"]):
        with pytest.raises(ValueError):
            check_arguments(parse(bad))
    fields = parse(["--workload", "mixed", "--batch-priority", "none", "--interactive-e2e-ms", "900"])
    from vllm_actors.bench.serve_policies import load_mixed

    requests = load_mixed(fields, 20.0, 1)
    assert all("priority" not in r.extra for r in requests if r.klass == "batch")
    assert all(r.extra["e2e_target_ms"] == 900.0 for r in requests if r.klass == "interactive")
    assert all(r.extra == {} for r in load_mixed(parse(["--workload", "mixed", "--no-request-fields"]), 20.0, 1))
