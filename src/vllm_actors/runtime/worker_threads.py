"""How many intra-op threads a worker's torch uses.

On the CPU every worker of a host shares its cores: with tensor parallelism N ranks, with data
parallelism M replicas of them, each rank's torch would by default start one thread per core, so
N x M x cores threads spin-wait on cores that the ranks' collectives need (TP=3 over gloo on two
cores ran 2x slower that way). Each CPU worker takes an equal share of the cores, at least one.
On a GPU the model's work is on the device and torch's default stays. ``VLLM_ACTORS_WORKER_THREADS``
overrides both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from vllm_actors.envs import Envs

WORKER_THREADS_ENV = "VLLM_ACTORS_WORKER_THREADS"


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def worker_threads(device_type: str, workers_on_host: int, environ: Mapping[str, str] | None = None,
                   cores: int | None = None) -> int | None:
    """Threads for one worker of ``workers_on_host`` on a ``device_type`` ("cpu", "cuda") device;
    None leaves torch's default (``environ`` None: this process's environment)."""
    threads = Envs(environ).VLLM_ACTORS_WORKER_THREADS
    if threads is not None:
        return threads
    if device_type != "cpu" or workers_on_host <= 1:
        return None
    return max(1, (available_cores() if cores is None else cores) // workers_on_host)
