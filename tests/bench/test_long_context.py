"""The long-context benchmark on the CPU: its context parser, model directory and floor; the peer
script's arguments and result shaping without vLLM or SGLang; the report's table; and one run of
``benchmarks/long_context.py`` end to end on a tiny Llama with our engine alone, over two pipeline
stages with ``--trace`` (each context's first measured prefill as a trace and a chunk table)."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib import long_context_run, peer_long
from benchmarks.lib.floor import ModelShape
from benchmarks.lib.long_context import main
from benchmarks.lib.long_context_model import (
    context_label,
    decode_floor,
    model_setup,
    parse_context,
    samples_plan,
)
from benchmarks.lib.long_context_process import copy_peer_script, run_process
from benchmarks.lib.long_context_report import add_engine_result, build_rows, format_markdown, new_report

from vllm_actors.bench.throughput_workload import LLAMA_3_2_1B_CONFIG

TINY_LLAMA3_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 384,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "eos_token_id": 0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 128},
}


# --------------------------------------------------------------------------- contexts and the model
def test_contexts_are_written_as_vllm_users_say_them() -> None:
    assert [parse_context(text) for text in ("16k", "128K", "1M", "4096", "0.5k", "1.5M", " 64k ")] == [
        16384, 131072, 1_000_000, 4096, 512, 1_500_000, 65536]
    for bad in ("16q", "", "k", "0", "1.0001k", "-1k", "1e6"):
        with pytest.raises(ValueError, match="context"):
            parse_context(bad)
    assert [context_label(n) for n in (131072, 1_000_000, 300, 2_000_000)] == ["128k", "1M", "300", "2M"]


def test_samples_plan_takes_one_sample_without_warm_up_from_512k_on() -> None:
    contexts = [16384, 131072, 524288, 1_000_000]
    assert samples_plan(contexts, None, True) == ([3, 3, 1, 1], [1, 1, 0, 0])
    assert samples_plan(contexts, 2, False) == ([2, 2, 2, 2], [0, 0, 0, 0])
    with pytest.raises(ValueError, match="repeats"):
        samples_plan(contexts, 0, True)


def test_model_setup_raises_max_position_embeddings_only_past_the_checkpoints(tmp_path: Path) -> None:
    assert LLAMA_3_2_1B_CONFIG["rope_scaling"]["rope_type"] == "llama3"
    shape = model_setup(None, "llama-3.2-1b", tmp_path / "a", 131072)
    assert shape.overrides == {} and shape.config["max_position_embeddings"] == 131072
    million = model_setup(None, "llama-3.2-1b", tmp_path / "b", 1_000_000)
    written = json.loads((Path(million.path) / "config.json").read_text())
    assert million.overrides == {"max_position_embeddings": 1_000_000} == {"max_position_embeddings":
                                                                           written["max_position_embeddings"]}
    assert written["rope_scaling"] == LLAMA_3_2_1B_CONFIG["rope_scaling"]  # llama3 scaling untouched

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(TINY_LLAMA3_CONFIG))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    assert model_setup(str(checkpoint), "llama-3.2-1b", tmp_path / "c", 384).path == str(checkpoint)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 96}
    linked = model_setup(str(checkpoint), "llama-3.2-1b", tmp_path / "d", 1000, rope_scaling=yarn)
    assert Path(linked.path) != checkpoint and (Path(linked.path) / "model.safetensors").read_bytes() == b"weights"
    edited = json.loads((Path(linked.path) / "config.json").read_text())
    assert edited["max_position_embeddings"] == 1000 and edited["rope_scaling"] == yarn
    assert json.loads((checkpoint / "config.json").read_text()) == TINY_LLAMA3_CONFIG  # the original stays
    with pytest.raises(ValueError, match="config.json"):
        model_setup(str(tmp_path), "llama-3.2-1b", tmp_path / "e", 1000)


def test_decode_floor_of_the_llama_1b_shape() -> None:
    shape = ModelShape.from_hf_config(LLAMA_3_2_1B_CONFIG)
    floor = decode_floor(shape, 131072, 3e12)
    assert floor.kv_bytes == 131072 * 16 * 2 * 8 * 64 * 2  # 4.3 GB: 32 KiB a token
    assert 2.4e9 < floor.weight_bytes < 2.5e9  # 1.24 B parameters, the embedding read once (tied)
    assert floor.ms_per_token == pytest.approx((floor.weight_bytes + floor.kv_bytes) / 3e12 * 1e3)
    tp2 = decode_floor(shape, 131072, 3e12, tensor_parallel_size=2)
    assert tp2.weight_bytes == floor.weight_bytes / 2 and tp2.kv_bytes == floor.kv_bytes / 2
    assert decode_floor(shape, 131072, 3e12, kv_cache_dtype="fp8").kv_bytes == floor.kv_bytes / 2
    assert decode_floor(shape, 131072, 3e12, tensor_parallel_size=16).kv_bytes == floor.kv_bytes / 8  # 8 KV heads
    with pytest.raises(ValueError):
        decode_floor(shape, 1, 0.0)


# --------------------------------------------------------------------------- the peer script
def _peer_args(*extra: str, engine: str = "vllm", contexts: tuple[str, ...] = ("1000", "4000")) -> list[str]:
    plan = ["--repeats", "3", "1", "--warmup", "1", "0"] if len(contexts) == 2 else ["--repeats", "3", "--warmup", "1"]
    return ["--engine", engine, "--model", "m", "--out", "r.json", "--contexts", *contexts, *plan,
            "--max-model-len", "4000", "--vocab-size", "512", *extra]


def test_peer_arguments() -> None:
    args = peer_long.parse_args(_peer_args("--kv-cache-dtype", "fp8", "--output-len", "64"))
    assert (args.contexts, args.repeats, args.warmup, args.output_len) == ([1000, 4000], [3, 1], [1, 0], 64)
    assert args.mem_fraction_static is None and args.kv_cache_dtype == "fp8"
    for bad in (_peer_args("--repeats", "3"), _peer_args("--max-model-len", "2000"), _peer_args("--output-len", "1"),
                _peer_args(engine="ours"), _peer_args(contexts=("100",)), _peer_args("--repeats", "0", "1")):
        with pytest.raises(SystemExit):
            peer_long.parse_args(bad)
    assert long_context_run.parse_args(_peer_args(engine="ours"), ("ours",)).engine == "ours"


def test_pipeline_stages_and_chunk_reach_our_engine() -> None:
    from benchmarks.lib.long_context_ours import engine_arguments

    args = long_context_run.parse_args(_peer_args("--pipeline-parallel-size", "2", "--max-num-batched-tokens", "2048",
                                     engine="ours"), ("ours",))
    kwargs = engine_arguments(args)
    assert kwargs["pipeline_parallel_size"] == 2 and kwargs["max_num_batched_tokens"] == 2048
    plain = long_context_run.parse_args(_peer_args(engine="ours"), ("ours",))
    assert "pipeline_parallel_size" not in engine_arguments(plain)


def test_peer_result_shaping() -> None:
    sample = long_context_run.shape_sample([(0.5, 1), (0.51, 2), (0.53, 4), (0.56, 8)], 8)
    assert sample["ttft_s"] == 0.5 and sample["full_s"] == 0.56 and sample["complete"] and sample["updates"] == 4
    assert sample["decode_ms_per_token"] == pytest.approx(60 / 7)
    assert long_context_run.shape_sample([(0.5, 3)], 4)["decode_ms_per_token"] is None  # one update: no decode
    with pytest.raises(RuntimeError, match="no token"):
        long_context_run.shape_sample([], 4)
    samples = [long_context_run.shape_sample([(t, 1), (t + 0.07, 8)], 8) for t in (0.4, 0.5, 0.9)]
    summary = long_context_run.summarize(1000, 872, 8, samples, None)
    assert summary["ttft_ms"] == pytest.approx(500) and summary["decode_ms_per_token"] == pytest.approx(10)
    assert summary["decode_method"] == "token_times" and summary["decode_subtract_ms_per_token"] == pytest.approx(10)
    assert long_context_run.prompt_len(131072, 128) == 131072 - 128 - long_context_run.PROMPT_MARGIN

    assert peer_long.sglang_completion_tokens({"output_ids": [1, 2], "meta_info": {"completion_tokens": 5}}) == 5
    assert peer_long.sglang_completion_tokens([{"output_ids": [1, 2, 3], "meta_info": {}}]) == 3
    assert [peer_long.sglang_kv_cache_dtype(d) for d in ("fp8", "auto", "fp8_e4m3")] == ["fp8_e4m3", "auto", "fp8_e4m3"]

    @dataclasses.dataclass
    class Settings:
        tp_size: int = 2

    class Resolved:
        def resolved_dict(self) -> dict[str, Any]:
            return {"context_length": 9}

    assert peer_long.as_plain_dict(Settings()) == {"tp_size": 2}
    assert peer_long.as_plain_dict(Resolved()) == {"context_length": 9}


class _FakeEngine:
    """Tokens every 10 ms after a TTFT of 1 ms per 1,000 prompt tokens; fails above 3,000 tokens."""

    name = "fake"

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.closed = False

    def start(self) -> dict[str, Any]:
        return {"version": "0"}

    def stream(self, prompt: list[int], max_tokens: int) -> long_context_run.Events:
        if len(prompt) > 3000:
            raise RuntimeError("out of memory")
        self.prompts.append(prompt)
        ttft = len(prompt) / 1e6
        return [(ttft + 0.01 * i, i + 1) for i in range(max_tokens)]

    def shutdown(self) -> None:
        self.closed = True


def test_run_engine_measures_every_context_and_keeps_the_failed_ones(tmp_path: Path) -> None:
    args = peer_long.parse_args(_peer_args("--out", str(tmp_path / "r.json"), "--output-len", "8"))
    engine = _FakeEngine()
    assert long_context_run.run_engine(engine, args) == 1  # the 4,000-token context fails
    result = json.loads((tmp_path / "r.json").read_text())
    assert engine.closed and result["settings"] == {"version": "0"} and result["startup_s"] >= 0
    first = result["contexts"]["1000"]
    assert first["repeats"] == 3 and first["warmup_s"] is not None and first["complete"]
    assert first["ttft_ms"] == pytest.approx(0.976) and first["decode_ms_per_token"] == pytest.approx(10)
    assert "out of memory" in result["contexts"]["4000"]["error"]
    # warm-up prompt, then the 1,000-token context's warm-up and samples: fresh prompts, all different
    assert len(engine.prompts) == 1 + 1 + 3 and len({tuple(p) for p in engine.prompts}) == 5
    assert all(0 <= token < 512 for prompt in engine.prompts for token in prompt)

    broken = _FakeEngine()
    broken.stream = lambda prompt, max_tokens: []  # type: ignore[method-assign]  # no token ever comes
    with pytest.raises(RuntimeError, match="no token"):
        long_context_run.run_engine(broken, args)
    result = json.loads((tmp_path / "r.json").read_text())
    assert broken.closed and result["error"].startswith("warm-up: RuntimeError") and result["contexts"] == {}


def test_peer_script_runs_alone_and_records_a_missing_engine(tmp_path: Path) -> None:
    """Copied to a folder of its own with the measurement it imports, and run without this project on the
    path, as on the GPU machine."""
    script = copy_peer_script(tmp_path)
    assert subprocess.run([sys.executable, "-I", str(script), "--help"], capture_output=True).returncode == 0
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    out = tmp_path / "r.json"
    completed = subprocess.run([sys.executable, "-I", str(script), *_peer_args("--out", str(out), engine="sglang")],
                               capture_output=True, text=True)
    assert completed.returncode != 0 and "sglang" in json.loads(out.read_text())["error"]


class _AdmittingEngine(_FakeEngine):
    """The fake engine with ``admit``: it refuses prompts above 3,500 tokens (a pool of 3,500)."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[int] = []

    def admit(self, prompt: list[int], seconds: float) -> str | None:
        self.offered.append(len(prompt))
        return "more tokens than the KV pool holds" if len(prompt) > 3500 else None


def test_a_probe_offers_the_whole_prompt_then_times_its_first_chunks(tmp_path: Path) -> None:
    args = peer_long.parse_args(_peer_args("--out", str(tmp_path / "r.json"), "--output-len", "8",
                                           "--prefill-probe-tokens", "500", "--admit-seconds", "0"))
    engine = _AdmittingEngine()
    assert long_context_run.run_engine(engine, args) == 1  # the 4,000-token context is refused
    result = json.loads((tmp_path / "r.json").read_text())
    probed = result["contexts"]["1000"]
    assert engine.offered == [1000 - 8 - long_context_run.PROMPT_MARGIN, 4000 - 8 - long_context_run.PROMPT_MARGIN]
    assert probed["context"] == 1000 and probed["prompt_len"] == 500 and probed["repeats"] == 3
    assert probed["admission"] == {"prompt_len": 976, "checked": True, "admitted": True, "error": None,
                                   "seconds": pytest.approx(probed["admission"]["seconds"])}
    assert probed["ttft_ms"] == pytest.approx(0.5)  # 1 ms per 1,000 tokens
    assert probed["probe"] == {"prompt_tokens": 500, "prefill_tok_s": pytest.approx(1e6)}
    assert "refused: more tokens than the KV pool holds" in result["contexts"]["4000"]["error"]
    # warm-up, then the probes' samples alone: no warm-up at a probed context
    assert [len(p) for p in engine.prompts] == [976, 500, 500, 500]

    report = new_report({"model_description": "fake", "tensor_parallel_size": 1, "kv_cache_dtype": "auto",
                         "output_len": 8})
    add_engine_result(report, "ours", result, "ours-0.log", None)
    build_rows(report, ModelShape.from_hf_config(LLAMA_3_2_1B_CONFIG), None, 1, "auto")
    table = format_markdown(report)
    assert "- 1000, ours: its 976-token prompt admitted; TTFT and decode above of prompts of its first 500 " \
           "tokens, prefill 1,000,000 tokens/s" in table
    with pytest.raises(ValueError, match="below the context's prompt"):
        long_context_run.probe_context(engine, 1000, 8, 976, 1, 0, 512, 0.0)
    plain = _FakeEngine()  # an engine that cannot admit: its prompt is not offered, the probe still runs
    entry = long_context_run.probe_context(plain, 1000, 8, 500, 1, 0, 512, 0.0)  # type: ignore[arg-type]
    assert entry["admission"] == {"prompt_len": 976, "checked": False} and entry["prompt_len"] == 500


def test_the_million_token_llama_3_8b_shape(tmp_path: Path) -> None:
    from vllm_actors.bench.throughput_workload import MODEL_SHAPES

    config = MODEL_SHAPES["llama-3-8b-1m"]
    shape = ModelShape.from_hf_config(config)
    kv_per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes
    assert kv_per_token == 128 * 1024 and kv_per_token * 1_000_000 / 2**30 == pytest.approx(122.07, abs=0.01)
    assert (config["rope_theta"], config["rope_scaling"], config["max_position_embeddings"]) == \
        (3580165449.0, None, 1048576)
    setup = model_setup(None, "llama-3-8b-1m", tmp_path, 1_000_000)  # a million tokens within its positions
    assert setup.overrides == {} and json.loads((Path(setup.path) / "config.json").read_text()) == config


# --------------------------------------------------------------------------- the report
def _context_result(context: int, ttft_ms: float, decode: float) -> dict[str, Any]:
    return {"context": context, "prompt_len": context - 144, "output_len": 128, "repeats": 3, "ttft_ms": ttft_ms,
            "decode_ms_per_token": decode, "complete": True}


def test_report_rows_compare_ours_with_the_best_peer() -> None:
    report = new_report({"model_description": "llama-3.2-1b shape", "tensor_parallel_size": 1,
                         "kv_cache_dtype": "auto", "output_len": 128})
    report["bandwidth"] = {"bytes_per_s": 3e12, "source": "given"}
    add_engine_result(report, "vllm", {"startup_s": 50.0, "contexts": {"131072": _context_result(131072, 2876, 2.8)}},
                      "vllm-0.log", None)
    add_engine_result(report, "sglang", {"startup_s": 40.0, "contexts": {"131072": _context_result(131072, 3000, 2.7)}},
                      "sglang-1.log", None)
    add_engine_result(report, "ours", {"startup_s": 9.0, "contexts": {"131072": _context_result(131072, 3855, 2.53),
                                                                     "16384": {"context": 16384, "error": "boom"}}},
                      "ours-2.log", None)
    build_rows(report, ModelShape.from_hf_config(LLAMA_3_2_1B_CONFIG), 3e12, 1, "auto")
    rows = {(row["context"], row["engine"]): row for row in report["rows"]}
    ours = rows[131072, "ours"]
    assert ours["ttft_ratio"] == pytest.approx(3855 / 2876) and ours["decode_ratio"] == pytest.approx(2.53 / 2.7)
    assert rows[131072, "vllm"]["ttft_ratio"] is None
    assert ours["percent_of_floor"] == pytest.approx(100 * report["floor"]["131072"]["ms_per_token"] / 2.53)
    assert 70 < ours["percent_of_floor"] < 95  # 2.5 GB of weights and 4.3 GB of KV at 3 TB/s: about 2.2 ms
    assert rows[16384, "ours"]["error"] == "boom" and rows[16384, "vllm"]["error"] == "not measured"
    assert [row["engine"] for row in report["rows"] if row["context"] == 131072] == ["ours", "vllm", "sglang"]
    table = format_markdown(report)
    assert "| 128k (131,072) | ours | 3,855.0 | 2.530 |" in table and "| 1.34 | 0.94 |" in table
    assert "3.00 TB/s, given" in table and "ours 9.0 s" in table

    # a later call with --append: ours again at 128k replaces the earlier figure
    add_engine_result(report, "ours", {"contexts": {"131072": _context_result(131072, 2800, 2.4)}}, "ours-3.log", None)
    build_rows(report, ModelShape.from_hf_config(LLAMA_3_2_1B_CONFIG), 3e12, 1, "auto")
    assert next(r for r in report["rows"] if r["engine"] == "ours" and r["context"] == 131072)["ttft_ms"] == 2800


def test_run_process_ends_a_process_past_its_time(tmp_path: Path) -> None:
    error = run_process([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "log", timeout=0.5)
    assert error is not None and "timed out" in error
    error = run_process([sys.executable, "-c", "print('bad'); raise SystemExit(3)"], {}, tmp_path / "log", timeout=30)
    assert error is not None and error.startswith("exit 3") and "bad" in error


# --------------------------------------------------------------------------- end to end
def test_main_runs_our_engine_on_a_tiny_llama(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "tiny-llama3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA3_CONFIG))
    out = tmp_path / "out"
    argv = ["--model", str(model), "--load-format", "dummy", "--dtype", "float32", "--engines", "ours",
            "--contexts", "256", "0.5k", "--output-len", "8", "--repeats", "2", "--bandwidth", "3e12",
            "-pp", "2", "--max-num-batched-tokens", "64", "--trace", "--out", str(out)]
    assert main(argv) == 0, (out / "ours-0.log").read_text()
    report = json.loads((out / "long_context.json").read_text())
    assert report["errors"] == {} and report["config"]["max_model_len"] == 512
    assert report["config"]["model_overrides"] == {"max_position_embeddings": 512}  # past the checkpoint's 384
    run = report["runs"][0]
    assert run["startup_s"] > 0 and run["settings"]["arguments"]["max_model_len"] == 512
    assert "kv_cache_dtype" not in run["settings"]["arguments"]  # only passed when not "auto"
    assert run["settings"]["arguments"]["pipeline_parallel_size"] == 2
    for context in ("256", "512"):
        measured = report["engines"]["ours"]["contexts"][context]
        assert measured["complete"] and measured["repeats"] == 2 and measured["decode_method"] == "token_times"
        assert measured["prompt_len"] == int(context) - 8 - long_context_run.PROMPT_MARGIN
        assert all(sample["tokens"] == 8 for sample in measured["samples"])
        assert measured["ttft_ms"] > 0 and measured["decode_ms_per_token"] > 0
        check_traced_prefill(out, measured)
    rows = report["rows"]
    assert [(row["context"], row["engine"]) for row in rows] == [(256, "ours"), (512, "ours")]
    assert all(row["percent_of_floor"] > 0 and row["ttft_ratio"] is None for row in rows)
    table = (out / "long_context.md").read_text()
    assert "| 256 | ours |" in table and "| 512 | ours |" in table and table in capsys.readouterr().out
    assert "SPP chunks at 256 (request long-2, the first measured sample)" in table  # after 2 warm-ups

    # --append with another output length is refused before any engine starts
    with pytest.raises(SystemExit, match="other settings"):
        main([*argv[:-2], "--output-len", "4", "--append", "--out", str(out)])


def check_traced_prefill(out: Path, measured: dict[str, Any]) -> None:
    """``--trace``: the first measured sample's prefill as a trace file and its chunk table, both stages in it."""
    record = measured["trace"]
    trace = json.loads(gzip.decompress((out / record["file"]).read_bytes()))
    assert record["file"] == f"trace-ours-{measured['context']}.json.gz" and record["complete"]
    assert trace["otherData"]["pipeline_bubbles"].keys() == {"stage 0", "stage 1"}
    chunks = record["chunks"]
    assert chunks["num_stages"] == 2 and chunks["num_chunks"] == len(chunks["chunks"]) > 1
    assert len({row["step_id"] for row in chunks["chunks"]}) == chunks["num_chunks"]  # a row per chunk
    computed = measured["prompt_len"] - chunks["cached_tokens"]
    assert sum(row["tokens"] for row in chunks["chunks"]) == chunks["computed_tokens"] == computed
    assert [stage["worker"] for stage in chunks["stages"]] == ["worker-0", "worker-1"]
    assert all(None not in row["stages"] for row in chunks["chunks"])
    assert all(stage["bubble_fraction"] is not None for stage in chunks["stages"])


def test_parser_defaults() -> None:
    from benchmarks.lib.long_context import build_parser

    args = build_parser().parse_args(["--contexts", "16k", "1M"])
    assert args.contexts == [16384, 1_000_000] and args.model_shape == "llama-3.2-1b"
    assert (args.engines, args.output_len, args.repeats, args.kv_cache_dtype) == (["ours", "vllm"], 128, None, "auto")
    assert (args.vllm_pythonpath, args.sglang_pythonpath) == ("/tmp/vsite", "/tmp/ssite")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--contexts", "16q"])
    assert isinstance(args, argparse.Namespace)
