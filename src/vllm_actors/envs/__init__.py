"""Every setting the package reads from the environment, each declared once: name, type, default,
parser and one line of documentation.

``envs.VLLM_ACTORS_LOG_LEVEL`` reads and parses the variable when it is read, so a test may
monkeypatch the environment without reloading any module; an empty value counts as unset (except
where ``keep_empty`` says it means something, as for ``CUDA_VISIBLE_DEVICES``), and a bad value
raises a ``ValueError`` that names the variable. ``Envs(mapping)`` reads another mapping instead
(functions that take an ``environ`` argument for their tests). Nothing else in ``src/`` reads
``os.environ`` (``tests/layout/test_layout.py``).

``python -m vllm_actors.envs --markdown > docs/settings.md`` writes the reference table
(``envs/table.py``); ``python -m vllm_actors.envs`` prints the values this process would use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Literal, TypeVar, cast, overload

from vllm_actors.models.router_skew import RouterSkew, parse_skew

T = TypeVar("T")
KernelChoice = Literal["auto", "torch", "triton"]

GROUPS = {
    "process": "Processes, logs and files",
    "engine": "Engine paths (switches for debugging and measuring)",
    "kernels": "Kernels",
    "tp": "Tensor parallelism",
    "alias": "Deprecated aliases of engine arguments",
    "other": "Read from other tools' variables",
}


# ------------------------------------------------------------------------------------ parsers
# Each takes the stripped text and returns the value, or raises ValueError("must be ...").
def parse_bool(text: str) -> bool:
    value = text.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 0 or 1 (or true/false, yes/no, on/off)")


def integer(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"must be a whole number >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"must be a whole number >= {minimum}")
        return value

    return parse


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number") from None


def positive_number(text: str) -> float:
    value = number(text)
    if not value > 0:
        raise ValueError("must be a number > 0")
    return value


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.lower()
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def fused_quant_mode(text: str) -> str:
    """``VLLM_ACTORS_FP8_FUSED_QUANT``: ``off``, ``eager`` (a true switch) or ``graphs``."""
    if text.lower() == "graphs":
        return "graphs"
    try:
        return "eager" if parse_bool(text) else "off"
    except ValueError:
        raise ValueError("must be 0, 1 or graphs") from None


def kernel_choice(text: str) -> KernelChoice:
    return cast(KernelChoice, choice("torch", "triton", "auto")(text))


LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG", "NOTSET")  # logging's names


def log_level(text: str) -> str:
    name = text.upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"must be a logging level ({', '.join(LOG_LEVELS)})")
    return name


def profile_window(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"([0-9]+):([0-9]+)", text)
    if match is None or int(match.group(2)) < 1:
        raise ValueError("must be FIRST:COUNT with COUNT >= 1 (e.g. 200:8)")
    return int(match.group(1)), int(match.group(2))


def text(value: str) -> str:
    return value


# ------------------------------------------------------------------------------------ the registry
class Setting(Generic[T]):
    """One variable: read through an ``Envs`` instance, declared as an attribute of ``Envs``."""

    name: str

    def __init__(self, default: T, parse: Callable[[str], T], doc: str, *, kind: str, group: str,
                 shown_default: str | None = None, keep_empty: bool = False) -> None:
        if group not in GROUPS:
            raise ValueError(f"unknown group {group!r}")
        self.default = default
        self.parse = parse
        self.doc = doc
        self.kind = kind  # the type as the table shows it
        self.group = group
        self.shown_default = shown_default if shown_default is not None else _shown(default)
        self.keep_empty = keep_empty  # an empty value is a value (else it counts as unset)
        self._last: tuple[str, T] | None = None  # the last text parsed and its value: parsed once per text

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, obj: Envs, owner: type) -> T: ...

    def __get__(self, obj: Envs | None, owner: type) -> Setting[T] | T:
        if obj is None:
            return self
        return self.read(obj.environ)

    def read(self, environ: Mapping[str, str]) -> T:
        raw = environ.get(self.name)
        if raw is None:
            return self.default
        last = self._last
        if last is not None and last[0] == raw:
            return last[1]
        stripped = raw if self.keep_empty else raw.strip()
        if not stripped and not self.keep_empty:
            return self.default
        try:
            value = self.parse(stripped)
        except ValueError as error:
            raise ValueError(f"{self.name} {error}, got {raw!r}") from None
        self._last = (raw, value)
        return value


def _shown(default: object) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "1" if default else "0"
    return str(default)


def switch(doc: str, group: str, default: bool = True) -> Setting[bool]:
    """A path turned on or off."""
    return Setting(default, parse_bool, doc, kind="bool", group=group)


def kernel_switch(what: str, group: str) -> Setting[KernelChoice]:
    """An op's "Triton or torch" (``kernels/choice.py``)."""
    return Setting[KernelChoice]("auto", kernel_choice, f"{what}: `triton`, `torch`, or `auto` (Triton on CUDA).",
                                 kind="auto, torch, triton", group=group)


class Envs:
    """The settings, read from ``environ`` (None: this process's environment, at every read)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    @classmethod
    def settings(cls) -> Iterator[Setting[Any]]:
        for value in vars(cls).values():
            if isinstance(value, Setting):
                yield value

    @classmethod
    def setting(cls, name: str) -> Setting[Any]:
        found = vars(cls).get(name)
        if not isinstance(found, Setting):
            raise KeyError(f"{name} is not a registered setting (vllm_actors/envs/__init__.py)")
        return found

    def is_set(self, name: str) -> bool:
        """Whether ``name`` holds a value here (an empty one counts as unset unless it means something)."""
        raw = self.environ.get(self.setting(name).name)
        return raw is not None and (self.setting(name).keep_empty or bool(raw.strip()))

    # --------------------------------------------------------------------- processes, logs, files
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

    # --------------------------------------------------------------------- engine paths
    VLLM_ACTORS_DEFER_STEPS = switch("The worker launches a step and reads its tokens back at the next one.", "engine")
    VLLM_ACTORS_PADDED_GRAPHS = switch(
        "Prefill and mixed steps replay CUDA graphs padded to the next token count.", "engine")
    VLLM_ACTORS_GRAPH_SAMPLER = switch(
        "Decode graphs also draw the tokens where every row needs only the fused sampler.", "engine")
    VLLM_ACTORS_TP_GRAPH_SAMPLER = switch(
        "Every tensor-parallel rank draws a sampling graph's tokens itself (0: rank 0 broadcasts).", "engine")
    VLLM_ACTORS_SPEC_ADAPTIVE = switch(
        "Speculative decoding drafts per step as many tokens as the step cost model and the observed acceptance "
        "say pay (0: always `num_speculative_tokens` where a draft is found).", "engine")
    VLLM_ACTORS_ALLOW_ORACLE_DRAFTER = switch(
        "Accept the speculative method `oracle`, which replays given greedy continuations at a set acceptance "
        "(benchmarks only: it measures the verification cost; see speculative.md).", "engine", default=False)
    VLLM_ACTORS_MOE_ROUTER_SKEW = Setting[RouterSkew | None](
        None, parse_skew, "Benchmarks only: mixture-of-experts routers choose experts Zipf-distributed (`zipf:S`: "
        "expert e with weight (e+1)^-S, drawn from a fixed table, as `benchmarks/throughput.py --moe-router-skew` "
        "sets it for both engines); unset: the model's own routing.", kind="zipf:S", group="engine")
    VLLM_ACTORS_DUMMY_WEIGHTS = Setting(
        "random", choice("random", "echo"), "Benchmarks only: the weights of `load_format=dummy`: random, or `echo` "
        "(residual projections scaled down, LM head equal to the embedding: greedy decoding repeats the last "
        "token by a wide logit margin under any kernel; the same shapes and cost; `models/echo_weights.py`).",
        kind="random, echo", group="engine")
    VLLM_ACTORS_SAMPLER = kernel_switch("Fused sampling kernel", "engine")
    VLLM_ACTORS_PENALTIES = kernel_switch("Penalties kernel", "engine")

    # --------------------------------------------------------------------- kernels
    VLLM_ACTORS_ATTENTION = kernel_switch("Paged attention", "kernels")
    VLLM_ACTORS_PREFILL_ATTENTION = Setting(
        "auto", choice("auto", "triton", "flash_attn"),
        "Prefill attention on Hopper: flash-attn 4 (`flash_attn.cute`) where installed and measured faster "
        "(`auto`), wherever it can run (`flash_attn`), or never (`triton`).",
        kind="auto, triton, flash_attn", group="kernels")
    VLLM_ACTORS_FLASH_ATTN_PACK_GQA = Setting(
        "auto", choice("auto", "on", "off"),
        "flash-attn 4 prefill over grouped KV heads: pack a KV head's query heads into one tile (`on`), one query "
        "head a tile (`off`), or flash-attn's own choice (`auto`: packed whenever heads are grouped).",
        kind="auto, on, off", group="kernels")
    VLLM_ACTORS_FP8_PREFILL_STAGING = switch(
        "Over an fp8 KV cache, a long one-sequence prefill chunk goes to flash-attn 4 through a bf16 staging of "
        "its context (where flash-attn runs; 0: the Triton kernel).", "kernels")
    VLLM_ACTORS_FUSED_OPS = kernel_switch("Fused RMSNorm, rotary, SiLU and embedding", "kernels")
    VLLM_ACTORS_FUSED_MOE = kernel_switch("Fused mixture-of-experts MLP (grouped GEMM over the tokens of each expert)",
                                          "kernels")
    VLLM_ACTORS_MOE_CONFIG = Setting[str | None](
        None, text, "A JSON file of tuned fused-MoE tiles per batch size (`benchmarks/moe_sweep.py` writes one), "
        "looked up before the tables shipped in `kernels/moe_configs/` (unset: those, else the built-in choice).",
        kind="path", group="kernels")
    VLLM_ACTORS_LORA_KERNEL = kernel_switch("Batched LoRA shrink and expand (the tokens of each adapter together)",
                                            "kernels")
    VLLM_ACTORS_FP8_GEMM = kernel_switch(
        "FP8 checkpoints' projections kept in FP8 (Triton FP8 GEMMs; `torch`: dequantized at load)", "kernels")
    VLLM_ACTORS_FP8_GEMV_SILU = switch(
        "At one row the FP8 down projection's weight-only GEMV applies SiLU(gate) * up itself (off: a separate "
        "silu_and_mul first; fused, the Qwen3-8B down projection took 45.0 us against 18.8 us unfused on an H200).",
        "kernels", default=False)
    VLLM_ACTORS_FP8_GEMV_ROWS = Setting(
        1, integer(0), "FP8 projections of up to this many rows (at most 4) run the weight-only GEMV, activations "
        "not quantized (0: the W8A8 GEMM and GEMV at every size; at 2 rows cuBLASLt's FP8 GEMM took 101 us a "
        "Qwen3-8B layer against the GEMV's 127 on an H200, at 4 rows the W8A8 GEMM was faster on an H100).",
        kind="int", group="kernels")
    VLLM_ACTORS_FP8_SCALED_MM = switch(
        "FP8 projections of [128, 128] blocks above the GEMV's rows run cuBLASLt's block-scaled FP8 GEMM "
        "(torch._scaled_mm) where a probe at first use gives the float64 reference's result (0: the Triton GEMM).",
        "kernels")
    VLLM_ACTORS_FP8_FUSED_QUANT = Setting(
        "graphs", fused_quant_mode, "FP8 projections above the GEMV's rows take their input quantized by the "
        "RMSNorm or SiLU(gate) * up before them (one kernel and one pass over the activations fewer, results "
        "identical): `1` in forwards run eagerly (prefill), `graphs` also inside the captured decode CUDA graphs "
        "(Qwen3-8B FP8 on an H200: 10,877 tok/s against 10,631 with `0`), `0` never.", kind="0, 1, graphs",
        group="kernels")
    VLLM_ACTORS_FP8_GEMM_CONFIG = Setting[str | None](
        None, text, "A JSON file of tuned Triton FP8 GEMM launches per weight shape and rows, and of the weight-only "
        "FP8 GEMV's at 1 to 4 rows (`benchmarks/fp8_gemm.py --sweep` and `--sweep-gemv` with `--table-out` write "
        "one), looked up before the tables shipped in `kernels/fp8_gemm_configs/` (unset: those, else the built-in "
        "choice).", kind="path", group="kernels")
    VLLM_ACTORS_FUSED_KV_WRITE = switch(
        "The rotary kernel also stores k and v in the KV cache (0: a separate write).", "kernels")
    VLLM_ACTORS_GEMV = switch("The Triton GEMV for projections of 1 or 2 rows (0: cuBLAS).", "kernels")
    VLLM_ACTORS_GEMV_SILU = switch("At one row the down projection's GEMV applies SiLU(gate) * up itself.", "kernels")
    VLLM_ACTORS_PDL = switch("Programmatic dependent launch of our Triton kernels (Hopper and later).", "kernels")
    VLLM_ACTORS_PDL_EARLY_LOADS = switch(
        "Under PDL, loads of what no recent kernel wrote move before the wait.", "kernels")

    # --------------------------------------------------------------------- tensor parallelism
    VLLM_ACTORS_TP_ALLREDUCE = Setting(
        "symm_mem", choice("nccl", "symm_mem", "symm_mem_one_shot"),
        "All-reduce: two-shot over symmetric memory in its band, one-shot, or NCCL alone.",
        kind="nccl, symm_mem, symm_mem_one_shot", group="tp")
    VLLM_ACTORS_TP_SYMM_MIN_BYTES = Setting(
        64 << 10, integer(0), "Smallest all-reduce through symmetric memory (0 sends every one, as tests do).",
        kind="int", group="tp")
    VLLM_ACTORS_TP_FUSED_NORM = switch("Fused all-reduce + add + RMSNorm over symmetric memory.", "tp")
    VLLM_ACTORS_TP_FUSED_LAMPORT = switch("The flagless fused all-reduce kernel (0: the flagged one).", "tp")

    # --------------------------------------------------------------------- deprecated aliases
    VLLM_ACTORS_STEPS_IN_FLIGHT = Setting(
        2, integer(1), "Deprecated: the engine argument `steps_in_flight`.", kind="int", group="alias")
    VLLM_ACTORS_DISABLE_EVENTS = switch("Deprecated: the engine argument `disable_events`.", "alias", default=False)
    VLLM_ACTORS_CHECK_INVARIANTS = switch("Deprecated: the engine argument `check_invariants`.", "alias", default=False)

    # --------------------------------------------------------------------- other tools' variables
    TRITON_INTERPRET = switch(
        "Triton's: kernels run in its interpreter (the CPU tests); read when kernels import.", "other", default=False)
    CUDA_VISIBLE_DEVICES = Setting[str | None](
        None, text, "CUDA's: an empty value hides every GPU (busy polling then stays off on `auto`).",
        kind="str", group="other", keep_empty=True)
    VLLM_API_KEY = Setting[str | None](
        None, text, "vLLM's: the API key the server requires where `--api-key` is not given.",
        kind="str", group="other")
    VLLM_SERVER_DEV_MODE = switch(
        "vLLM's: the server's development endpoints (`/server_info`, `/reset_prefix_cache`, `/sleep`, "
        "`/wake_up`, `/is_sleeping`) are registered.", "other", default=False)
    VLLM_PP_LAYER_PARTITION = Setting[str | None](
        None, text, "vLLM's: the layers of each pipeline stage, comma-separated (`10,14`: 10 on the first stage); "
        "unset, an even split (the first stages take one more where it does not divide).", kind="str", group="other")
    VLLM_ALLOW_RUNTIME_LORA_UPDATING = switch(
        "vLLM's: the server's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` endpoints are registered.",
        "other", default=False)
    VLLM_TORCH_PROFILER_DIR = Setting[str | None](
        None, text, "vLLM's: the workers run torch.profiler between `POST /start_profile` and `/stop_profile` "
        "(registered only then) and write the trace here.", kind="path", group="other")
    PROMETHEUS_MULTIPROC_DIR = Setting[str | None](
        None, text, "prometheus_client's: set by `serve --api-server-count` above 1, histograms shared there.",
        kind="path", group="other")


envs = Envs()

# Former settings, now constants in the code (their measurements: benchmarks/RESULTS.md).
REMOVED = {
    "VLLM_ACTORS_GEMV_BLOCK_N": "`kernels/gemv.py` `GemvConfig.block_n` (8)",
    "VLLM_ACTORS_GEMV_BLOCK_K": "`kernels/gemv.py` `GemvConfig.block_k` (1024)",
    "VLLM_ACTORS_GEMV_WARPS": "`kernels/gemv.py` `GemvConfig.warps` (4)",
    "VLLM_ACTORS_GEMV_STAGES": "`kernels/gemv.py` `GemvConfig.stages` (2)",
    "VLLM_ACTORS_GEMV_PREFETCH": "`kernels/gemv.py` `GemvConfig.prefetch` (2)",
    "VLLM_ACTORS_DECODE_BLOCK_N": "`kernels/triton_decode.py` `DECODE_BLOCK_N` (128)",
    "VLLM_ACTORS_DECODE_WAVES": "`kernels/triton_decode.py` `DECODE_WAVES` (2)",
    "VLLM_ACTORS_DECODE_ORDER": "`kernels/triton_decode.py` `DECODE_ORDERED` (longest context first)",
    "VLLM_ACTORS_DECODE_MAX_SPLITS": "`kernels/triton_decode.py` `DECODE_MAX_SPLITS` (64)",
    "VLLM_ACTORS_TP_SYMM_MAX_BYTES": "`models/parallel.py` `SYMM_MAX_BYTES` (8 MiB)",
    "VLLM_ACTORS_TP_FUSED_NORM_MAX_BYTES": "`models/fused_all_reduce.py` `FUSED_MAX_BYTES` (8 MiB)",
}
