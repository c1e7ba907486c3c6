"""Launch parameters of the Triton W8A8 FP8 GEMM (``kernels/fp8_gemm.py``) per weight shape and rows.

Each program computes a ``block_m`` x ``block_n`` tile of the output over K in ``block_k`` steps (at
most the scale block's width, so one activation and one weight scale per row and column and step),
with ``group_m`` row tiles visited together so that a weight tile is still in L2 for the next row
tile, and a ``stages``-deep software pipeline of ``warps`` warps, its tiles loaded by pointers or
(``tma``) through tensor descriptors. An entry also says whether cuBLASLt's block-scaled GEMM
(``kernels/fp8_scaled_mm.py``), where its probe passed, runs at its rows instead (``cublas``, the
default; the sweep writes false where the Triton GEMM measured faster). Few rows want a narrow M tile and
many column tiles (the GEMM reads weights); hundreds want 64x128-class tiles (it computes; Hopper's
warpgroup MMA wants M tiles of 64). ``default_launch`` picks by rows alone; a tuned table
(``benchmarks/fp8_gemm.py --sweep --table-out`` writes one) overrides it for the (N, K, block,
device) it was measured on: the file ``VLLM_ACTORS_FP8_GEMM_CONFIG`` names first, then the tables
shipped in ``kernels/fp8_gemm_configs/``. A table's entry is taken at the measured row count nearest
the call's (log scale), as for the fused MoE (``kernels/moe_config.py``, ``kernels/tuned_tables.py``).
A table may also carry the weight-only GEMV's launches at 1 to 4 rows (``gemv``, read by
``kernels/fp8_gemv_config.py``; ``choose_gemv``), so that one file tunes both kernels for a shape.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm_actors.envs import envs
from vllm_actors.kernels import tuned_tables
from vllm_actors.kernels.fp8_gemv_config import Fp8GemvConfig, parse_gemv

FORMAT = "vllm_actors.fp8_gemm/1"
SHIPPED = Path(__file__).with_name("fp8_gemm_configs")
SHARED_BYTES = 227 * 1024  # SM90's shared memory a block may opt into
BLOCK_MS = (16, 32, 64, 128, 256)
BLOCK_NS = (16, 32, 64, 128, 256)
BLOCK_KS = (16, 32, 64, 128)
WARPS = (2, 4, 8)
WHAT = "FP8 GEMM configs"


@dataclass(frozen=True)
class GemmLaunch:
    """One launch of the GEMM: output tile, K step (capped at the scale block's width at launch),
    row tiles grouped per column sweep, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    warps: int = 4
    stages: int = 3
    tma: bool = False  # tiles loaded through tensor descriptors (Hopper's TMA) instead of pointers
    cublas: bool = True  # where cuBLASLt's block-scaled GEMM probed right it runs instead (false: Triton was faster)

    def to_json(self) -> dict[str, int | bool]:
        return asdict(self)


def shared_bytes(launch: GemmLaunch) -> int:
    """Shared memory of the pipeline: per stage an FP8 activation tile and an FP8 weight tile."""
    return launch.stages * (launch.block_m + launch.block_n) * launch.block_k


def fit_stages(launch: GemmLaunch) -> GemmLaunch:
    """``launch`` with as many of its stages as SM90's shared memory holds (at least 1)."""
    while launch.stages > 1 and shared_bytes(launch) > SHARED_BYTES:
        launch = replace(launch, stages=launch.stages - 1)
    return launch


# (rows up to, launch): the tiles vLLM's tuned H100 tables settle on for most shapes
_DEFAULTS = (
    (16, GemmLaunch(16, 64, 128, 16, 4, 4)),
    (32, GemmLaunch(16, 128, 128, 16, 4, 4)),
    (128, GemmLaunch(64, 64, 128, 32, 4, 3)),
)
_LARGE = GemmLaunch(64, 128, 128, 32, 4, 3)


def default_launch(rows: int) -> GemmLaunch:
    """By rows alone: narrow M tiles up to 32 rows, 64x64 up to 128, 64x128 above."""
    return next((launch for most, launch in _DEFAULTS if rows <= most), _LARGE)


# ------------------------------------------------------------------------------------ tuned tables
def parse_launch(raw: Any, where: str) -> GemmLaunch:
    """One table entry (``GemmLaunch.to_json``'s form); a ValueError naming ``where`` if malformed."""
    allowed = {"block_m", "block_n", "block_k", "group_m", "warps", "stages", "tma", "cublas"}
    if not isinstance(raw, dict) or set(raw) - allowed or {"block_m", "block_n"} - set(raw):
        raise ValueError(f"{where} must be an object with keys among {sorted(allowed)} (block_m, block_n required)")
    launch = GemmLaunch(**raw)
    tuned_tables.check_fields(launch, where, {"block_m": BLOCK_MS, "block_n": BLOCK_NS, "block_k": BLOCK_KS,
                                              "warps": WARPS, "stages": range(1, 9)})
    for name in ("tma", "cublas"):
        if not isinstance(getattr(launch, name), bool):
            raise ValueError(f"{where}.{name} is {getattr(launch, name)!r}: must be true or false")
    return launch


Table = dict[int, GemmLaunch]  # rows -> launch
GemvTable = dict[int, Fp8GemvConfig]  # rows (1 to 4) -> the weight-only GEMV's launch
TableKey = tuple[int, int, str, str]  # N, K, block ("128x128", or "channel"), device name ("any": every device)
Tables = tuple[dict[TableKey, Table], dict[TableKey, GemvTable]]  # a file's GEMM and GEMV tables


def block_key(block: tuple[int, int] | None) -> str:
    return f"{block[0]}x{block[1]}" if block is not None else "channel"


def parse_file(text: str, source: str) -> Tables:
    """A tuned-config file: {"format": FORMAT, "tables": [{"n": N, "k": K, "block": [128, 128] or null,
    "device": "<torch.cuda.get_device_name()> or any", "configs": {"<rows>": <launch>, ...},
    "gemv": {"<rows>": <GEMV launch>, ...}}, ...]} (a table holds configs, gemv or both, and may say
    where its numbers come from in "source"): its GEMM tables and its GEMV tables."""
    data = tuned_tables.read_json(text, WHAT, source)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tables"), list):
        raise ValueError(f"{WHAT} {source}: need an object with \"format\": \"{FORMAT}\" and a \"tables\" list")
    tables: dict[TableKey, Table] = {}
    gemv_tables: dict[TableKey, GemvTable] = {}
    for i, table in enumerate(data["tables"]):
        where = f"{WHAT} {source}: tables[{i}]"
        if (not isinstance(table, dict) or {"n", "k", "block", "device"} - set(table)
                or not {"configs", "gemv"} & set(table)):
            raise ValueError(f"{where} needs n, k, block, device and configs (or gemv, or both)")
        n, k, block = table["n"], table["k"], table["block"]
        if not (isinstance(n, int) and isinstance(k, int) and n > 0 and k > 0):
            raise ValueError(f"{where}: n and k must be whole numbers > 0, got {n!r} and {k!r}")
        if block is not None and not (isinstance(block, list) and len(block) == 2
                                      and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}.block must be [block_n, block_k] or null (per channel), got {block!r}")
        key = (n, k, block_key(tuple(block) if block else None), str(table["device"]))
        if "configs" in table:
            tables[key] = tuned_tables.parse_sized(table["configs"], where, "row count", parse_launch)
        if "gemv" in table:
            gemv_tables[key] = parse_gemv(table["gemv"], where, block[0] if block else None)
    return tables, gemv_tables


def parse_tables(text: str, source: str) -> dict[TableKey, Table]:
    """The GEMM tables of a tuned-config file (``parse_file``)."""
    return parse_file(text, source)[0]


def parse_gemv_tables(text: str, source: str) -> dict[TableKey, GemvTable]:
    """The GEMV tables of a tuned-config file (``parse_file``)."""
    return parse_file(text, source)[1]


def table_json(n: int, k: int, block: tuple[int, int] | None, device: str, configs: Table,
               source: str | None = None, gemv: GemvTable | None = None) -> dict[str, Any]:
    """One table of a tuned-config file (``parse_file``'s form; ``configs`` or ``gemv`` may be empty)."""
    table: dict[str, Any] = {"n": n, "k": k, "block": list(block) if block else None, "device": device}
    if source:
        table["source"] = source
    if configs:
        table["configs"] = {str(rows): launch.to_json() for rows, launch in sorted(configs.items())}
    if gemv:
        table["gemv"] = {str(rows): launch.to_json() for rows, launch in sorted(gemv.items())}
    return table


def dumps(tuned: dict[str, Any]) -> str:
    """A tuned-config file's text: one line per table field and per row count's launch."""
    tables = []
    for table in tuned["tables"]:
        fields = [f'  "{key}": {json.dumps(value)}' for key, value in table.items() if key not in ("configs", "gemv")]
        for name in ("configs", "gemv"):
            if name in table:
                launches = ",\n".join(f'   "{rows}": {json.dumps(launch)}' for rows, launch in table[name].items())
                fields.append(f'  "{name}": {{\n' + launches + "\n  }")
        tables.append(" {\n" + ",\n".join(fields) + "\n }")
    return f'{{"format": {json.dumps(tuned["format"])}, "tables": [\n' + ",\n".join(tables) + "\n]}\n"


@lru_cache(maxsize=8)
def _load(path: str) -> Tables:
    return tuned_tables.load(path, WHAT, parse_file)


def _sources() -> tuple[str, ...]:
    override = envs.VLLM_ACTORS_FP8_GEMM_CONFIG
    return ((override,) if override else ()) + tuned_tables.shipped(SHIPPED)


def tuned_table(n: int, k: int, block: tuple[int, int] | None, device: str) -> Table | None:
    """The first table of the sources (override first) for this weight shape, block and device."""
    return tuned_tables.lookup((_load(source)[0] for source in _sources()),
                               lambda name: (n, k, block_key(block), name), device)


def tuned_gemv_table(n: int, k: int, block: tuple[int, int] | None, device: str) -> GemvTable | None:
    """The first GEMV table of the sources (override first) for this weight shape, block and device."""
    return tuned_tables.lookup((_load(source)[1] for source in _sources()),
                               lambda name: (n, k, block_key(block), name), device)


@lru_cache(maxsize=4096)
def _choose(rows: int, n: int, k: int, block: tuple[int, int] | None, device: str, sources: tuple[str, ...]
            ) -> GemmLaunch:
    table = tuned_table(n, k, block, device) if sources else None
    return fit_stages(tuned_tables.nearest(table, rows) if table is not None else default_launch(rows))


def choose_launch(rows: int, n: int, k: int, block: tuple[int, int] | None, device: str) -> GemmLaunch:
    """The tuned entry for this shape, block and device where a table has one, else ``default_launch``."""
    return _choose(rows, n, k, block, device, _sources())


@lru_cache(maxsize=4096)
def _choose_gemv(rows: int, n: int, k: int, block: tuple[int, int] | None, device: str, sources: tuple[str, ...]
                 ) -> Fp8GemvConfig | None:
    table = tuned_gemv_table(n, k, block, device) if sources else None
    return tuned_tables.nearest(table, rows) if table is not None else None


def choose_gemv(rows: int, n: int, k: int, block: tuple[int, int] | None, device: str) -> Fp8GemvConfig | None:
    """The weight-only GEMV's tuned launch for this shape, block and device at the measured row count
    nearest ``rows`` where a table has one (cached per shape), else None (``Fp8GemvConfig()``)."""
    return _choose_gemv(rows, n, k, block, device, _sources())
