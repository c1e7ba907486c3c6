"""``benchmarks/long_context.py --batch N``: N prompts of a context at once, decode timed as a step of them
all (where the KV dominates the bytes, e.g. 32 sequences of 16k), the floor reading all their KV."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib import long_context_run, peer_long
from benchmarks.lib.floor import ModelShape
from benchmarks.lib.long_context import main
from benchmarks.lib.long_context_model import decode_floor
from benchmarks.lib.long_context_report import add_engine_result, build_rows, format_markdown, new_report

from tests.bench.test_long_context import TINY_LLAMA3_CONFIG, _peer_args
from vllm_actors.bench.throughput_workload import LLAMA_3_2_1B_CONFIG


def _steps(first_s: float, tokens: int, step_s: float = 0.01) -> long_context_run.Events:
    return [(first_s + step_s * i, i + 1) for i in range(tokens)]


def test_a_batch_decodes_from_its_last_first_token_to_its_first_end() -> None:
    """A's prefill ran first: it decodes alone until B's first token; the window is [B's first, A's end]."""
    sample = long_context_run.shape_batch_sample([_steps(0.10, 8), _steps(0.13, 8)], 8)
    assert sample["ttft_s"] == pytest.approx(0.115) and sample["all_first_token_s"] == pytest.approx(0.13)
    assert sample["decode_steps"] == 4 and sample["decode_ms_per_token"] == pytest.approx(10)
    assert sample["batch"] == 2 and sample["complete"] and sample["full_s"] == pytest.approx(0.20)
    apart = long_context_run.shape_batch_sample([_steps(0.10, 4), _steps(0.30, 4)], 4)  # never all decoding at once
    assert apart["decode_ms_per_token"] is None
    with pytest.raises(RuntimeError, match="no token"):
        long_context_run.shape_batch_sample([_steps(0.1, 4), []], 4)


class _BatchEngine:
    """Steps of 10 ms: request i's prefill ends at step i (one a step), then it decodes a token a step."""

    name = "fake"

    def __init__(self) -> None:
        self.batches: list[list[list[int]]] = []

    def start(self) -> dict[str, Any]:
        return {}

    def stream(self, prompt: list[int], max_tokens: int) -> long_context_run.Events:
        return _steps(len(prompt) / 1e6, max_tokens)

    def stream_batch(self, prompts: list[list[int]], max_tokens: int) -> list[long_context_run.Events]:
        self.batches.append(prompts)
        return [[(0.01 * (step + 1), step - i + 1) for step in range(i, i + max_tokens)] for i in range(len(prompts))]

    def shutdown(self) -> None:
        pass


def test_run_engine_times_batches_after_a_discarded_one(tmp_path: Path) -> None:
    args = peer_long.parse_args(_peer_args("--out", str(tmp_path / "r.json"), "--output-len", "64", "--batch", "3",
                                           contexts=("1000",)))
    engine = _BatchEngine()
    assert long_context_run.run_engine(engine, args) == 0
    entry = json.loads((tmp_path / "r.json").read_text())["contexts"]["1000"]
    assert entry["batch"] == 3 and entry["decode_method"] == "batch_steps" and entry["repeats"] == 3
    assert entry["decode_ms_per_token"] == pytest.approx(10) and entry["warmup_s"] is not None
    assert entry["ttft_ms"] == pytest.approx(20)  # the middle of three prefills of a step each
    prompts = [tuple(p) for batch in engine.batches for p in batch]
    assert len(engine.batches) == 4 and len(set(prompts)) == 12  # a warm-up batch, then three: fresh prompts

    class Single(_BatchEngine):
        stream_batch = None  # type: ignore[assignment]

    with pytest.raises(RuntimeError, match="cannot run --batch 3"):
        long_context_run.run_engine(Single(), args)
    assert "cannot run --batch 3" in json.loads((tmp_path / "r.json").read_text())["error"]
    with pytest.raises(SystemExit):
        peer_long.parse_args(_peer_args("--batch", "2", "--prefill-probe-tokens", "100"))


def test_the_floor_of_a_batch_reads_every_sequences_kv() -> None:
    shape = ModelShape.from_hf_config(LLAMA_3_2_1B_CONFIG)
    entry = {"context": 16384, "prompt_len": 16240, "output_len": 128, "repeats": 1, "ttft_ms": 900.0,
             "decode_ms_per_token": 12.0, "complete": True, "batch": 32}
    report = new_report({"model_description": "llama-3.2-1b shape", "tensor_parallel_size": 1,
                         "kv_cache_dtype": "fp8", "output_len": 128, "batch": 32})
    add_engine_result(report, "ours", {"contexts": {"16384": entry}}, "ours-0.log", None)
    build_rows(report, shape, 4e12, 1, "fp8", batch=32)
    floor = decode_floor(shape, 32 * (16240 + 64), 4e12, 1, "fp8")
    assert report["rows"][0]["floor_ms_per_token"] == pytest.approx(floor.ms_per_token)
    assert floor.kv_bytes > 2 * floor.weight_bytes  # the KV dominates: where fp8 halves most of the step
    assert "32 requests at once" in format_markdown(report)


def test_our_engine_decodes_a_batch_on_a_tiny_llama(tmp_path: Path) -> None:
    model = tmp_path / "tiny-llama3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA3_CONFIG))
    out = tmp_path / "out"
    argv = ["--model", str(model), "--load-format", "dummy", "--dtype", "float32", "--engines", "ours",
            "--contexts", "256", "--output-len", "12", "--repeats", "1", "--no-context-warmup", "--batch", "3",
            "--bandwidth", "3e12", "--out", str(out)]
    assert main(argv) == 0, (out / "ours-0.log").read_text()
    report = json.loads((out / "long_context.json").read_text())
    measured = report["engines"]["ours"]["contexts"]["256"]
    sample = measured["samples"][0]
    assert measured["batch"] == 3 and sample["batch"] == 3 and sample["complete"] and sample["tokens"] == 12
    assert sample["decode_steps"] > 0 and measured["decode_ms_per_token"] > 0
    with pytest.raises(SystemExit, match="not with --trace"):
        main([*argv, "--trace"])
