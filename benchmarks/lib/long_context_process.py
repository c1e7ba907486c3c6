"""``benchmarks/long_context.py``'s processes: every engine, and the copy-bandwidth measurement,
runs in a process of its own (a session of its own, ended whole on timeout), so that the GPU is
left to each alone and the benchmark's own process never holds GPU memory."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.lib import long_context_run, peer_long

REPO = Path(__file__).resolve().parents[2]


def ours_env() -> dict[str, str]:
    """Our Python's environment with the repository importable (benchmarks.lib)."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""))


def run_process(command: list[str], env: dict[str, str], log_path: Path, timeout: float) -> str | None:
    """Run ``command`` in a session of its own, its output into ``log_path``; an error or None. On
    timeout the whole session (the engine's own processes too) is ended."""
    with log_path.open("w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, None)):
                try:
                    os.killpg(process.pid, sig)
                    process.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            return f"timed out after {timeout:.0f} s"
    if code == 0:
        return None
    tail = " | ".join(log_path.read_text(errors="replace").splitlines()[-8:])
    return f"exit {code}: {tail}"


def measure_bandwidth(out_dir: Path) -> dict[str, Any] | None:
    """The copy bandwidth, in a process of its own so that this one holds no GPU memory."""
    code = ("import json, torch\n"
            "from benchmarks.lib.floor import measure_copy_bandwidth\n"
            "samples = measure_copy_bandwidth() if torch.cuda.is_available() else []\n"
            "print(json.dumps({'samples': samples, 'device': torch.cuda.get_device_name() if samples else None}))\n")
    log = out_dir / "bandwidth.log"
    if run_process([sys.executable, "-c", code], ours_env(), log, timeout=600) is not None:
        return None
    measured = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
    if not measured["samples"]:
        return None
    samples = sorted(measured["samples"])
    return {"bytes_per_s": samples[len(samples) // 2], "source": "measured", "device": measured["device"],
            "samples": measured["samples"]}


def copy_peer_script(folder: Path) -> Path:
    """peer_long.py and the measurement it imports, copied to a folder of their own (lib/'s other modules
    shadow nothing there); the script's path."""
    for module in (peer_long, long_context_run):
        source = Path(str(module.__file__))
        shutil.copyfile(source, folder / source.name)
    return folder / "peer_long.py"


def engine_command(args: argparse.Namespace, engine: str, scratch: Path,
                   common: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one engine's process (``common``: long_context_run.py's arguments)."""
    if engine == "ours":
        return [sys.executable, "-m", "benchmarks.lib.long_context_ours", "--engine", "ours", *common], ours_env()
    script = copy_peer_script(scratch)
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1")
    pythonpath = getattr(args, f"{engine}_pythonpath")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    extra = []
    if engine == "sglang" and args.sglang_mem_fraction_static is not None:
        extra = ["--mem-fraction-static", str(args.sglang_mem_fraction_static)]
    return [getattr(args, f"{engine}_python"), str(script), "--engine", engine, *common, *extra], env
