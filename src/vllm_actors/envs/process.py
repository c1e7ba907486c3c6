"""The settings of processes, logs and files (group ``process``)."""

from __future__ import annotations

from vllm_actors.envs.parsers import choice, integer, log_level, number, positive_number, profile_window, text
from vllm_actors.envs.setting import Setting, switch


class ProcessSettings:
    """The ``process`` group's settings (``Envs`` inherits them)."""

    VLLM_ACTORS_LOG_LEVEL = Setting(
        "WARNING", log_level, "Log level of every process (`INFO` for more; `DEBUG` adds tracebacks).",
        kind="level", group="process")
    VLLM_ACTORS_LOG_RATE = Setting(
        10, integer(0), "Log lines a second of one kind (level and event), ten times that in all; 0: no limit.",
        kind="int", group="process")
    VLLM_ACTORS_RUN_ROOT = Setting[str | None](
        None, text, "Where process groups make their run directories.",
        kind="path", group="process", shown_default="`/tmp/vllm-actors-<uid>`")
    VLLM_ACTORS_GC_FREEZE = switch(
        "Freeze the start-up heap out of the garbage collector's way in every process.", "process")
    VLLM_ACTORS_BUSY_POLL_MS = Setting[float | None](
        None, number, "Milliseconds an engine actor polls without blocking after a message; 0: off.",
        kind="float", group="process", shown_default="20 on CUDA, 0 on the CPU")
    VLLM_ACTORS_BORROW_SWITCH_US = Setting(
        200, integer(0), "Python's thread switch interval in a worker under `kv_borrowing` (its lender threads "
        "answer every layer of a guest beside the busy main thread); 0: Python's default (5,000).",
        kind="int", group="process")
    VLLM_ACTORS_BORROW_TRANSPORT = Setting(
        "shm", choice("shm", "gloo"), "Where borrowed KV's q, k, v and answers travel between the replicas of one "
        "host: shared memory (gloo carries the headers) or their bytes over gloo.", kind="shm, gloo", group="process")
    VLLM_ACTORS_WORKER_THREADS = Setting[int | None](
        None, integer(1), "Intra-op threads of every worker.",
        kind="int", group="process", shown_default="CPU: a share of the cores; GPU: torch's")
    VLLM_ACTORS_METRICS_MAX_EVENTS = Setting[int | None](
        None, integer(1), "Events the metrics store keeps (e.g. the trace of a whole benchmark run).",
        kind="int", group="process", shown_default="50000")
    VLLM_ACTORS_METRICS_MAX_BYTES = Setting[int | None](
        None, integer(1), "Estimated bytes of events the metrics store keeps.",
        kind="int", group="process", shown_default="the store's")
    VLLM_ACTORS_PROFILE_STEPS = Setting[tuple[int, int] | None](
        None, profile_window, "`FIRST:COUNT`: every worker profiles that window of steps (torch.profiler).",
        kind="FIRST:COUNT", group="process")
    VLLM_ACTORS_PROFILE_DIR = Setting(
        "vllm-actors-profiles", text, "Where the step profiles are written.", kind="path", group="process")
    VLLM_ACTORS_RESPONSES_STORE_SIZE = Setting(
        1000, integer(0), "Responses the HTTP server keeps for `previous_response_id` and `GET /v1/responses/{id}` "
        "(least recently used dropped first); 0: none (`store` is then ignored, as vLLM without its store).",
        kind="int", group="process")
    VLLM_ACTORS_CPU_KVCACHE_SPACE = Setting[float | None](
        None, positive_number, "GiB of the KV pool on the CPU, where `cpu_kv_cache_gib` is not given.",
        kind="float", group="process", shown_default="1.0")
    VLLM_ACTORS_SPP_MIN_CHUNK_TOKENS = Setting[int | None](
        None, integer(1), "The smallest prefill chunk sequence pipeline parallelism plans, where the engine argument "
        "`spp_min_chunk_tokens` is not given.", kind="int", group="process", shown_default="1024")
    VLLM_ACTORS_KV_OFFLOAD_WRITE_THROUGH_TOKENS = Setting(
        16384, integer(0), "With a host KV tier, the KV blocks of prompts this long are copied there as they are "
        "computed, so that a restarted worker resumes them from host memory instead of recomputing them; 0: never.",
        kind="int", group="process")
    VLLM_ACTORS_KV_OFFLOAD_FD = Setting[int | None](
        None, integer(0), "Set by the supervisor for its workers: the descriptor of the host KV tier's shared memory, "
        "which outlives a worker (unset: the worker's own memory).", kind="int", group="process")
    VLLM_ACTORS_ALLOW_LONG_MAX_MODEL_LEN = switch(
        "Accept a `max_model_len` above the model's derived limit (vLLM's `VLLM_ALLOW_LONG_MAX_MODEL_LEN`; "
        "positions past the limit give wrong outputs).", "process", default=False)
