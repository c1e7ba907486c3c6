"""``benchmarks/throughput.py``: ``vllm-actors bench throughput`` plus what our engine is compared
with, in this order after our engines are shut down (the GPU is left to each part alone):

1. batch-1 decode by the client's clock, measured as the vLLM peer measures it (while our timed
   run's engine is still up);
2. the GPU's copy bandwidth and bf16 matmul rate, and the workload's floor from them (floor.py);
3. the peers named by ``--peer`` on the same requests: transformers (peer_transformers.py), vLLM's
   offline ``LLM`` (peer_vllm.py) and SGLang's offline ``Engine`` (peer_sglang.py), each of the
   last two in a process of its own under its own packages, one after the other;
4. ``--mix``: the plain and the mixed workload instead of the parts above (throughput_mix.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import structlog

from benchmarks.lib import peer_common, peer_sglang, peer_vllm, peer_vllm_skew, throughput_mix
from benchmarks.lib.compare_report import ComparisonReport
from benchmarks.lib.floor import Floor, GpuCeilings, ModelShape, measure_ceilings, workload_floor
from vllm_actors.bench import throughput
from vllm_actors.bench.report import BenchReport
from vllm_actors.bench.throughput import Extension, Setup, part
from vllm_actors.bench.throughput_engine import EngineSession
from vllm_actors.bench.throughput_workload import TEMPERATURE, Workload
from vllm_actors.models import router_skew

log = structlog.get_logger(__name__)

PEERS = ("transformers", "vllm", "sglang", "none")


def add_comparison_arguments(parser: argparse.ArgumentParser) -> None:
    mix = parser.add_argument_group("mix")
    mix.add_argument("--mix", choices=throughput_mix.MIXES, default="none",
                     help="json-penalties: 10%% JSON schema, the rest penalties; json: the 10%% alone; "
                          "penalties: all; each against plain on one engine (throughput_mix.py)")

    floor = parser.add_argument_group("floor")
    floor.add_argument("--no-floor", action="store_true", help="do not measure the GPU's ceilings")
    floor.add_argument("--bandwidth", type=float, default=None,
                       help="bytes/s to compute the floor with instead of the measured copy bandwidth")
    floor.add_argument("--matmul-rate", type=float, default=None,
                       help="FLOP/s to compute the floor with instead of the measured bf16 matmul rate")

    peer = parser.add_argument_group("peer")
    peer.add_argument("--peer", nargs="+", choices=PEERS, default=["transformers"],
                      help="one or more: vllm / sglang: the engine's offline API on the same workload, each in "
                           "its own process (peer_vllm.py, peer_sglang.py), one after the other")
    peer.add_argument("--no-peer", dest="peer", action="store_const", const=["none"], help="same as --peer none")
    peer.add_argument("--peer-num-requests", type=int, default=None,
                      help="run the peer on the first N requests only (default: --num-requests)")
    peer.add_argument("--peer-attn", default=None,
                      help="transformers attn_implementation (default: its paged sdpa)")
    peer.add_argument("--peer-only", action="store_true",
                      help="run only the engine peers of --peer (vllm, sglang) on the workload, not ours: a peer "
                           "whose start takes minutes (vLLM with FP8 weights) then gets a GPU of its own beside "
                           "our run of the same arguments")
    peer.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds")
    peer.add_argument("--vllm-python", default=sys.executable, help="the Python that runs vLLM")
    peer.add_argument("--vllm-pythonpath", default="/tmp/vsite",
                      help="PYTHONPATH of vLLM's process (where its packages are; '' to inherit ours)")
    peer.add_argument("--sglang-python", default=sys.executable, help="the Python that runs SGLang")
    peer.add_argument("--sglang-pythonpath", default="/tmp/ssite",
                      help="PYTHONPATH of SGLang's process (benchmarks/kits/sglang installs it there)")
    peer.add_argument("--sglang-attention-backend", default="fa3", help="SGLang's --attention-backend")


def build_parser() -> argparse.ArgumentParser:
    parser = throughput.build_parser("benchmarks/throughput.py")
    add_comparison_arguments(parser)
    return parser


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def model_shape(model_path: str, dtype: str) -> ModelShape | None:
    """The floor's figures of a dense model; None for a mixture of experts (the floor's model reads
    every weight at every step and has no term for routed experts)."""
    from vllm_actors.models.config import ModelConfig

    config = ModelConfig.from_path(model_path)
    if config.num_experts:
        return None
    dtype_bytes = 4 if dtype in ("float32", "float") else 2
    return ModelShape(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings, qk_norm=config.qk_norm, dtype_bytes=dtype_bytes,
    )


def compute_floor(
    args: argparse.Namespace, shape: ModelShape, workload: Workload
) -> tuple[GpuCeilings | None, Floor | None]:
    ceilings: GpuCeilings | None = None
    bandwidth, rate = args.bandwidth, args.matmul_rate
    if (bandwidth is None or rate is None) and not args.no_floor:
        if _cuda_available():
            ceilings = measure_ceilings()
            bandwidth = bandwidth if bandwidth is not None else ceilings.bandwidth
            rate = rate if rate is not None else ceilings.matmul_rate
        else:
            log.warning("no CUDA device: the GPU's ceilings are not measured (give --bandwidth and --matmul-rate "
                        "to compute the floor anyway)")
    if bandwidth is None or rate is None:
        return ceilings, None
    floor = workload_floor(
        [len(prompt) for prompt in workload.prompts], workload.max_tokens, shape,
        bandwidth=bandwidth, matmul_rate=rate, max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
    )
    log.info("floor", seconds=round(floor.seconds, 3), tok_s=round(floor.tokens_per_s, 1))
    return ceilings, floor


def run_peer(args: argparse.Namespace, model_path: str, workload: Workload, random_weights: bool) -> Any:
    if not _cuda_available():
        log.warning("no CUDA device: the transformers peer is skipped")
        return None
    from benchmarks.lib.peer_transformers import run_transformers_peer

    subset = workload.head(args.peer_num_requests or len(workload))
    return run_transformers_peer(
        model_path, subset.prompts, subset.max_tokens, random_weights=random_weights, temperature=TEMPERATURE,
        seed=args.seed, attn_implementation=args.peer_attn, timeout_s=args.peer_timeout,
    )


# The separate-process peers: their script, and what their process needs in its environment.
PEER_MODULES = {"vllm": peer_vllm, "sglang": peer_sglang}
PEER_ENV = {"vllm": {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                     "HF_HUB_OFFLINE": "1"},
            "sglang": {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "SGLANG_DISABLE_REQUEST_LOGGING": "1"}}


def run_engine_peer(
    engine: str, args: argparse.Namespace, model_path: str, load_format: str, workload: Workload, scratch_dir: Path,
    vocab_size: int, mix: str = "none",
) -> dict[str, Any]:
    """``engine``'s peer script (peer_vllm.py or peer_sglang.py, with peer_common.py beside it) in a
    process of its own, under that engine's Python and PYTHONPATH; its JSON result (with ``error``
    when it failed, and what it measured before that)."""
    module = PEER_MODULES[engine]
    folder = scratch_dir / f"peer-{engine}"  # a folder of its own: lib/'s modules shadow nothing
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / Path(str(module.__file__)).name
    shutil.copyfile(str(module.__file__), script)
    shutil.copyfile(str(peer_common.__file__), folder / "peer_common.py")
    workload_path, result_path = folder / "workload.json", folder / "result.json"
    content: dict[str, Any] = {"prompts": workload.prompts, "max_tokens": workload.max_tokens}
    if mix != "none":  # plain and mixed runs, with the tokenizer (throughput_mix.py)
        content["mix"] = throughput_mix.mix_fields(mix, len(workload))
    workload_path.write_text(json.dumps(content))
    python, pythonpath = getattr(args, f"{engine}_python"), getattr(args, f"{engine}_pythonpath")
    command = [
        python, str(script), "--model", model_path, "--workload", str(workload_path),
        "--out", str(result_path), "--load-format", load_format, "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed),
        "--runs", str(max(1, args.runs)), "--warmup-requests", str(args.warmup_requests),
        "--batch1-input-len", str(args.batch1_input_len), "--batch1-output-len", str(args.batch1_output_len),
        "--vocab-size", str(vocab_size), "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--pipeline-parallel-size", str(args.pipeline_parallel_size),
        *(["--enforce-eager"] if args.enforce_eager else []),
        *(["--no-enable-prefix-caching"] if not args.enable_prefix_caching else []),
        *(["--no-batch1"] if args.no_batch1 else []),
        *(["--attention-backend", args.sglang_attention_backend] if engine == "sglang" else []),
    ]
    if args.moe_router_skew is not None:  # vLLM's side of the skewed router (peer_vllm_skew.py)
        if engine != "vllm":
            raise ValueError(f"--moe-router-skew is applied to vLLM's peer only, not to {engine}'s")
        command += ["--moe-router-skew", args.moe_router_skew]
        for source in (peer_vllm_skew.__file__, router_skew.__file__):
            shutil.copyfile(str(source), folder / Path(str(source)).name)
    env = dict(os.environ, **PEER_ENV[engine], **(peer_vllm_skew.ENV if args.moe_router_skew else {}))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    log.info("starting a peer", engine=engine, command=" ".join(command))
    completed = subprocess.run(command, env=env, timeout=args.peer_timeout, check=False, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    (Path(args.out) / f"{engine}_peer.log").write_text(completed.stdout)
    result: dict[str, Any] = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if completed.returncode != 0:
        result["error"] = f"exit {completed.returncode}: " + " | ".join(completed.stdout.splitlines()[-12:])
    return result


def run_vllm_peer(
    args: argparse.Namespace, model_path: str, load_format: str, workload: Workload, scratch_dir: Path,
    vocab_size: int, mix: str = "none",
) -> dict[str, Any]:
    """vLLM's peer (``run_engine_peer``), as ``throughput_mix.run`` calls it."""
    return run_engine_peer("vllm", args, model_path, load_format, workload, scratch_dir, vocab_size, mix)


def batch1_client(args: argparse.Namespace, session: EngineSession, vocab_size: int) -> dict[str, Any]:
    """Batch-1 by the client's clock, measured as the peers measure it (peer_common.client_batch1)."""
    result = peer_common.client_batch1(lambda prompt, n: session.generate([prompt], [n])[1], args.batch1_input_len,
                                     args.batch1_output_len, args.seed + 7, vocab_size)
    log.info("batch-1 (client clock)", ttft_ms=round(result["ttft_s"] * 1e3, 2),
             ms_per_token=round(result["ms_per_token"], 3))
    return result


class Comparisons(Extension):
    """The parts of this module's docstring, added to ``vllm_actors.bench.throughput.run``."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_comparison_arguments(parser)

    def make_report(self, config: dict[str, Any]) -> BenchReport:
        return ComparisonReport(config=config)

    def instead(self, args: argparse.Namespace, setup: Setup, report: BenchReport) -> int | None:
        if args.peer_only:
            return self._peers_only(args, setup, report)
        if args.mix == "none":
            return None
        mix = throughput_mix.run(args, setup.workload, setup.load_format, setup.scratch_dir, run_vllm_peer)
        print(throughput_mix.format_mix(mix))
        return 0 if "error" not in mix.get("ours", {}) else 1

    def _peers_only(self, args: argparse.Namespace, setup: Setup, report: BenchReport) -> int:
        """``--peer-only``: the engine peers of ``--peer`` alone, into the report; 1 if one failed."""
        engines = [engine for engine in PEER_MODULES if engine in args.peer]
        if not engines:
            raise SystemExit(f"--peer-only needs an engine peer in --peer ({', '.join(PEER_MODULES)}), got "
                             f"{' '.join(args.peer)}")
        for engine in engines:
            with part(report, f"peer_{engine}", setup.out_json):
                result = run_engine_peer(engine, args, setup.model_path, setup.load_format, setup.workload,
                                         setup.scratch_dir, setup.vocab_size)
                setattr(report, f"peer_{engine}", result)
        return 1 if report.errors else 0

    def with_engine(self, args: argparse.Namespace, setup: Setup, session: EngineSession,
                    report: BenchReport) -> None:
        assert isinstance(report, ComparisonReport)
        if not args.no_batch1:
            with part(report, "batch1_client", setup.out_json):
                report.batch1_client = batch1_client(args, session, setup.vocab_size)

    def after_ours(self, args: argparse.Namespace, setup: Setup, report: BenchReport, ok: bool) -> None:
        assert isinstance(report, ComparisonReport)
        with part(report, "floor", setup.out_json):
            shape = model_shape(setup.model_path, args.dtype)
            if shape is None:
                log.info("no floor for a mixture-of-experts model")
            else:
                report.ceilings, report.floor = compute_floor(args, shape, setup.workload)
        if ok and "transformers" in args.peer and args.moe_router_skew is not None:
            report.errors["peer"] = "--moe-router-skew is applied to vLLM's peer only (pass --peer vllm)"
        elif ok and "transformers" in args.peer:
            with part(report, "peer", setup.out_json):
                report.peer = run_peer(args, setup.model_path, setup.workload,
                                       random_weights=setup.load_format == "dummy")
        for engine in PEER_MODULES:
            if engine in args.peer:
                with part(report, f"peer_{engine}", setup.out_json):
                    setattr(report, f"peer_{engine}", run_engine_peer(
                        engine, args, setup.model_path, setup.load_format, setup.workload, setup.scratch_dir,
                        setup.vocab_size))


def main(argv: list[str] | None = None) -> int:
    return throughput.main(argv, Comparisons(), prog="benchmarks/throughput.py")
