"""Launch parameters of the weight-only FP8 GEMV (``kernels/fp8_gemv.py``) and their entries in the
FP8 GEMM's tuned tables (``kernels/fp8_gemm_config.py``): a table may carry, next to the GEMM's
``configs``, a ``gemv`` object of row count (1 to 4) -> launch, so that one file from one sweep
(``benchmarks/fp8_gemm.py --sweep-gemv --table-out``) tunes both. An entry is checked when the file
is read: powers of two, the kernel's limits, and columns per program that divide the scale block's
rows (a program's columns must lie in one row of blocks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_actors.kernels import tuned_tables
from vllm_actors.kernels.gemv import GemvConfig

MAX_ROWS = 4  # what the kernel takes
MAX_PREFETCH = 2  # float8 tiles a one-row program may load before its PDL wait
BLOCK_NS = (1, 2, 4, 8, 16, 32, 64)
BLOCK_KS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
WARPS = (1, 2, 4, 8, 16)
FIELDS = ("block_n", "block_k", "warps", "stages", "prefetch", "tiles")


@dataclass(frozen=True)
class Fp8GemvConfig(GemvConfig):
    """The bf16 GEMV's launch parameters (``GemvConfig``) and ``tiles``: a float8 tile is half the bf16
    tile's bytes for the same float32 accumulator, so a one-row step loads two tiles into it (as many
    bytes in flight as the bf16 GEMV's step). A tuned table's ``gemv`` entry overrides it per weight
    shape and rows (``benchmarks/fp8_gemm.py --sweep-gemv --table-out`` writes one)."""

    tiles: int = 2  # tiles a one-row loop step loads (1 or 2)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefetch > MAX_PREFETCH:
            raise ValueError(f"prefetch must be 0..{MAX_PREFETCH}, got {self.prefetch}")
        if self.tiles not in (1, 2):
            raise ValueError(f"tiles must be 1 or 2, got {self.tiles}")
        powers = self.block_n >= 1 and self.block_k >= 16 and not self.block_n & (self.block_n - 1)
        if not powers or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_n and block_k must be powers of two (block_k >= 16), got {self.block_n}, "
                             f"{self.block_k}")

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def parse_gemv_launch(raw: Any, where: str, group_n: int | None) -> Fp8GemvConfig:
    """One ``gemv`` entry (``Fp8GemvConfig.to_json``'s form) of a table whose scale blocks have
    ``group_n`` rows (None: a scale per channel); a ValueError naming ``where`` if malformed."""
    if not isinstance(raw, dict) or set(raw) - set(FIELDS) or {"block_n", "block_k"} - set(raw):
        raise ValueError(f"{where} must be an object with keys among {list(FIELDS)} (block_n, block_k required)")
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in raw.values()):
        raise ValueError(f"{where}: every field must be a whole number, got {raw}")
    config = Fp8GemvConfig(**raw)
    tuned_tables.check_fields(config, where, {"block_n": BLOCK_NS, "block_k": BLOCK_KS, "warps": WARPS,
                                              "stages": range(1, 9), "prefetch": range(MAX_PREFETCH + 1),
                                              "tiles": (1, 2)})
    if group_n is not None and group_n % config.block_n:
        raise ValueError(f"{where}.block_n is {config.block_n}: must divide the scale block's {group_n} rows "
                         "(a program's columns lie in one row of blocks)")
    return config


def parse_gemv(raw: Any, where: str, group_n: int | None) -> dict[int, Fp8GemvConfig]:
    """A table's ``gemv`` object: row count (1 to ``MAX_ROWS``, as a string) -> launch."""
    configs = tuned_tables.parse_sized(raw, where, "row count",
                                       lambda entry, at: parse_gemv_launch(entry, at, group_n), field="gemv")
    if max(configs) > MAX_ROWS:
        raise ValueError(f"{where}.gemv: row counts must be 1..{MAX_ROWS} (the GEMV's rows), got {max(configs)}")
    return configs
