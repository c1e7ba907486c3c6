"""Launch parameters of the fused MoE kernel (``kernels/fused_moe.py``) per batch size and shape.

A step of T tokens routes T*k (token, choice) pairs over E experts: about T*k/E rows per expert on
average, but trained routers are skewed: the hottest experts get several times their share. At
decode the mean is under one row, so every program streams weight tiles for a single live row: the
GEMM is a read of the routed experts' weights and wants BLOCK_M 16 (the smallest ``tl.dot`` tile),
wide K tiles, deep pipelines and enough column tiles to keep every SM loading. Each row block of an
expert re-reads that expert's weight tiles, so BLOCK_M is sized for the hot experts
(``HOT_EXPERT_LOAD`` times the mean rows in at most two blocks) while the padding of the average
expert stays cheap: up to 4x its rows (at most 64) while the GEMM is a weight read, 2x once it
computes. With hundreds of rows per expert (prefill) it is compute bound and wants 64x128-class
tiles grouped along M so that an expert's weight tile stays in L2 across its row blocks.
``default_config`` derives such a config; a tuned table (``benchmarks/moe_sweep.py`` writes it,
timed under uniform and skewed routing) overrides it for the (shape, dtype, device) it was measured
on: the file ``VLLM_ACTORS_MOE_CONFIG`` names first, then the tables shipped in
``kernels/moe_configs/``. A table's entry is taken at the measured batch size nearest to T (on a
log scale). Both GEMMs share BLOCK_M (one alignment of the pairs) and have their own column/K tiles.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm_actors.envs import envs
from vllm_actors.kernels import tuned_tables
from vllm_actors.kernels.tuned_tables import nearest

FORMAT = "vllm_actors.fused_moe/1"
SHIPPED = Path(__file__).with_name("moe_configs")
SHARED_BYTES = 227 * 1024  # SM90's shared memory a block may opt into
BLOCK_MS = (16, 32, 64, 128)
TILE_SIZES = (16, 32, 64, 128, 256)
WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's tiles: output columns and reduction step per program, M-blocks grouped per column
    sweep (L2 reuse of a weight tile), warps and software-pipeline stages."""

    block_n: int
    block_k: int
    group_m: int = 1
    warps: int = 4
    stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # sorted pairs per program, shared by both GEMMs
    gate_up: GemmTiles
    down: GemmTiles

    def to_json(self) -> dict[str, Any]:
        return {"block_m": self.block_m, "gate_up": asdict(self.gate_up), "down": asdict(self.down)}


@dataclass(frozen=True)
class MoeShape:
    """One rank's expert shapes: gate_up is N = 2 * intermediate over K = hidden, down N = hidden
    over K = intermediate."""

    experts: int
    hidden: int
    intermediate: int
    top_k: int

    def key(self) -> str:
        return f"E={self.experts},H={self.hidden},I={self.intermediate},k={self.top_k}"


def shared_bytes(block_m: int, tiles: GemmTiles, gate_up: bool, element_bytes: int) -> int:
    """Shared memory of the pipeline: per stage an activation tile and one (down) or two (gate and
    up) weight tiles."""
    weight_tiles = 2 if gate_up else 1
    return tiles.stages * (block_m * tiles.block_k + weight_tiles * tiles.block_k * tiles.block_n) * element_bytes


def fit_stages(block_m: int, tiles: GemmTiles, gate_up: bool, element_bytes: int) -> GemmTiles:
    """``tiles`` with as many of its stages as SM90's shared memory holds (at least 1)."""
    stages = tiles.stages
    while stages > 1 and shared_bytes(block_m, GemmTiles(tiles.block_n, tiles.block_k, tiles.group_m, tiles.warps,
                                                         stages), gate_up, element_bytes) > SHARED_BYTES:
        stages -= 1
    return GemmTiles(tiles.block_n, tiles.block_k, tiles.group_m, tiles.warps, stages)


# the hottest expert's rows over the mean rows per expert that BLOCK_M is sized for: trained routers
# give their hottest expert several times its share (4-16x), where random weights give about 1x
HOT_EXPERT_LOAD = 8
# (gate_up, down) tiles per BLOCK_M above decode; GROUP_M where experts hold several row blocks
_TILES = {
    16: (GemmTiles(64, 128, 1, 4, 4), GemmTiles(64, 128, 1, 4, 4)),
    32: (GemmTiles(64, 128, 4, 4, 3), GemmTiles(128, 64, 4, 4, 3)),
    64: (GemmTiles(64, 64, 8, 4, 3), GemmTiles(128, 64, 8, 8, 3)),
    128: (GemmTiles(64, 64, 8, 8, 3), GemmTiles(128, 64, 8, 8, 3)),  # two 128x64 accumulators: one 128x128
}


def default_block_m(tokens: int, shape: MoeShape) -> int:
    """The smallest BLOCK_M holding the expected hottest expert (``HOT_EXPERT_LOAD`` times the mean
    rows, at most every token) in two blocks; the average expert padded to at most 4x its rows (64 at
    most: free while the GEMM reads weights) or 2x (once it computes)."""
    rows = tokens * shape.top_k / shape.experts
    hot = min(rows * HOT_EXPERT_LOAD, tokens)
    cap = max(BLOCK_MS[0], 2 * rows, min(4 * rows, 64))
    fits = [m for m in BLOCK_MS if m <= cap]
    return next((m for m in fits if 2 * m >= hot), fits[-1])


def default_config(tokens: int, shape: MoeShape, element_bytes: int = 2) -> MoeConfig:
    """First-principles tiles by the rows per expert, T * k / E, and the hot experts' (module docstring)."""
    if tokens * shape.top_k <= shape.experts:  # decode: a weight stream; narrow gate/up columns: ~2 programs per SM
        config = MoeConfig(16, GemmTiles(32, 256, 1, 4, 4), GemmTiles(64, 128, 1, 4, 4))
    else:
        block_m = default_block_m(tokens, shape)
        config = MoeConfig(block_m, *_TILES[block_m])
    return MoeConfig(config.block_m, fit_stages(config.block_m, config.gate_up, True, element_bytes),
                     fit_stages(config.block_m, config.down, False, element_bytes))


# ------------------------------------------------------------------------------------ tuned tables
def _tiles(raw: Any, where: str) -> GemmTiles:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object with block_n, block_k, group_m, warps, stages")
    allowed = {"block_n", "block_k", "group_m", "warps", "stages"}
    if set(raw) - allowed or {"block_n", "block_k"} - set(raw):
        raise ValueError(f"{where} has keys {sorted(raw)}: allowed {sorted(allowed)} (block_n, block_k required)")
    tiles = GemmTiles(**{name: raw[name] for name in raw})
    tuned_tables.check_fields(tiles, where, {"block_n": TILE_SIZES, "block_k": TILE_SIZES, "warps": WARPS,
                                             "stages": range(1, 9)})
    return tiles


def parse_config(raw: Any, where: str) -> MoeConfig:
    """One table entry (``MoeConfig.to_json``'s form); a ValueError naming ``where`` if malformed."""
    if not isinstance(raw, dict) or set(raw) != {"block_m", "gate_up", "down"}:
        raise ValueError(f"{where} must be an object with exactly block_m, gate_up and down")
    if raw["block_m"] not in BLOCK_MS or not isinstance(raw["block_m"], int):
        raise ValueError(f"{where}.block_m is {raw['block_m']!r}: must be one of {list(BLOCK_MS)}")
    return MoeConfig(raw["block_m"], _tiles(raw["gate_up"], f"{where}.gate_up"), _tiles(raw["down"], f"{where}.down"))


Table = dict[int, MoeConfig]  # tokens -> config
TableKey = tuple[str, str, str]  # shape key, dtype name, device name ("any" matches every device)


def parse_tables(text: str, source: str) -> dict[TableKey, Table]:
    """A tuned-config file: {"format": FORMAT, "tables": [{"shape": {experts, hidden, intermediate,
    top_k}, "dtype": "bfloat16", "device": "<torch.cuda.get_device_name()> or any", "configs":
    {"<tokens>": <config>, ...}}, ...]}."""
    data = tuned_tables.read_json(text, "fused MoE configs", source)
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("tables"), list):
        raise ValueError(f"fused MoE configs {source}: need an object with \"format\": \"{FORMAT}\" and a "
                         "\"tables\" list")
    tables: dict[TableKey, Table] = {}
    for i, table in enumerate(data["tables"]):
        where = f"fused MoE configs {source}: tables[{i}]"
        if not isinstance(table, dict) or {"shape", "dtype", "device", "configs"} - set(table):
            raise ValueError(f"{where} needs shape, dtype, device and configs")
        try:
            shape = MoeShape(**{name: int(table["shape"][name]) for name in ("experts", "hidden", "intermediate",
                                                                             "top_k")})
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}.shape needs whole numbers experts, hidden, intermediate, top_k") from None
        tables[(shape.key(), str(table["dtype"]), str(table["device"]))] = tuned_tables.parse_sized(
            table["configs"], where, "token count", parse_config)
    return tables


@lru_cache(maxsize=8)
def _load(path: str) -> dict[TableKey, Table]:
    return tuned_tables.load(path, "fused MoE configs", parse_tables)


def _sources() -> tuple[str, ...]:
    override = envs.VLLM_ACTORS_MOE_CONFIG
    return ((override,) if override else ()) + tuned_tables.shipped(SHIPPED)


def tuned_table(shape: MoeShape, dtype: str, device: str) -> Table | None:
    """The first table of the sources (override first) for this shape, dtype and device."""
    return tuned_tables.lookup((_load(source) for source in _sources()), lambda name: (shape.key(), dtype, name),
                               device)


@lru_cache(maxsize=1024)
def _choose(tokens: int, shape: MoeShape, dtype: str, device: str, element_bytes: int, sources: tuple[str, ...]
            ) -> MoeConfig:
    table = tuned_table(shape, dtype, device) if sources else None
    return nearest(table, tokens) if table is not None else default_config(tokens, shape, element_bytes)


def choose_config(tokens: int, shape: MoeShape, dtype: str, device: str, element_bytes: int = 2) -> MoeConfig:
    """The tuned entry for this shape, dtype and device where a table has one, else ``default_config``."""
    return _choose(tokens, shape, dtype, device, element_bytes, _sources())
