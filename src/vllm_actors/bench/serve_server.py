"""``vllm-actors bench serve``'s servers: the model directory of the random Qwen3-0.6B shape and
the server processes (ours, vLLM's, SGLang's), each in its own session."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from vllm_actors.bench.throughput_workload import QWEN3_0_6B_CONFIG

VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1"}
SGLANG_ENV = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"}
# SGLang's resolved server arguments worth a line in the report (what could not be made equal).
SGLANG_REPORTED = ("attention_backend", "sampling_backend", "context_length", "chunked_prefill_size",
                   "max_prefill_tokens", "max_running_requests", "cuda_graph_max_bs", "mem_fraction_static",
                   "page_size", "schedule_policy", "disable_radix_cache", "version")


# --------------------------------------------------------------------------- model directory
def write_model_dir(path: Path, config: dict[str, Any] | None = None) -> Path:
    """config.json (Qwen3-0.6B's shape) plus a word-level tokenizer over the whole vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = dict(config or QWEN3_0_6B_CONFIG)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    vocab = {f"t{i}": i for i in range(int(config["vocab_size"]))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    eos = f"t{config.get('eos_token_id', 0)}"
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(config["max_position_embeddings"]),
        "eos_token": eos, "unk_token": "t0", "pad_token": eos, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- servers
def server_command(engine: str, args: argparse.Namespace, model: str, load_format: str) -> list[str]:
    common = [model, "--load-format", load_format, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.max_num_seqs), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              "--host", "127.0.0.1", "--port", str(args.port), "--disable-uvicorn-access-log",
              "--uvicorn-log-level", "warning", *shlex.split(args.server_args)]
    if engine == "vllm":
        return [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", *common]
    if engine == "sglang":
        return sglang_command(args, model, load_format)
    return [sys.executable, "-m", "vllm_actors", "serve", *common]


def sglang_command(args: argparse.Namespace, model: str, load_format: str) -> list[str]:
    """SGLang's server at its defaults for the context length (its radix cache on, its own batch
    limits and memory share), with the PyTorch sampler: FlashInfer's sampling kernels would be
    compiled with nvcc on every fresh machine. ``--sglang-args`` adds to it (e.g. the attention backend)."""
    return [args.sglang_python, "-m", "sglang.launch_server", "--model-path", model, "--load-format", load_format,
            "--dtype", args.dtype, "--context-length", str(args.max_model_len), "--host", "127.0.0.1",
            "--port", str(args.port), "--sampling-backend", "pytorch", "--log-level", "warning",
            *shlex.split(args.sglang_args)]


def server_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "vllm":
        env.update(VLLM_ENV)
        if args.vllm_pythonpath:
            env["PYTHONPATH"] = args.vllm_pythonpath
    if engine == "sglang":
        env.update(SGLANG_ENV)
        if args.sglang_pythonpath:
            env["PYTHONPATH"] = args.sglang_pythonpath
    return env


def sglang_settings(url: str) -> dict[str, Any]:
    """The SGLang server's resolved arguments (``/server_info``) that the report names."""
    info = http_json(f"{url}/server_info", timeout=30.0)
    return {key: info.get(key) for key in SGLANG_REPORTED}


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a local benchmark URL
        return json.loads(response.read())


def served_model(url: str) -> str:
    return str(http_json(f"{url}/v1/models")["data"][0]["id"])


class Server:
    """A server process in its own session (so that stopping it stops its children too)."""

    def __init__(self, engine: str, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.engine, self.command, self.log_path = engine, command, log_path
        self.log = log_path.open("w")
        started = time.monotonic()
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.started = started
        self.startup_s = 0.0

    def wait_ready(self, url: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.process.returncode}: "
                                   f"{self.tail()}")
            try:
                model = served_model(url)
                self.startup_s = time.monotonic() - self.started
                return model
            except OSError:
                time.sleep(0.1)  # startup_s to a tenth of a second (a second's polls cost ~0.5 s a server)
        raise TimeoutError(f"{self.engine} server not up after {timeout:.0f} s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        self.log.flush()
        return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # children left in the session (workers, engine cores)
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()
