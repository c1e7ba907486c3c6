"""Every setting the package reads from the environment, each declared once: name, type, default,
parser and one line of documentation.

``envs.VLLM_ACTORS_LOG_LEVEL`` reads and parses the variable when it is read, so a test may
monkeypatch the environment without reloading any module; an empty value counts as unset (except
where ``keep_empty`` says it means something, as for ``CUDA_VISIBLE_DEVICES``), and a bad value
raises a ``ValueError`` that names the variable. ``Envs(mapping)`` reads another mapping instead
(functions that take an ``environ`` argument for their tests). Nothing else in ``src/`` reads
``os.environ`` (``tests/layout/test_layout.py``).

``Envs`` inherits the settings of each group from its module: ``process.py``, ``engine.py``,
``kernels.py``, ``tensor_parallel.py``, ``aliases.py``, ``other_tools.py`` (``setting.py``: a
setting; ``parsers.py``: their parsers). Every name is importable from here.

``python -m vllm_actors.envs --markdown > docs/settings.md`` writes the reference table
(``envs/table.py``); ``python -m vllm_actors.envs`` prints the values this process would use.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from vllm_actors.envs.aliases import DeprecatedAliases
from vllm_actors.envs.engine import EngineSettings
from vllm_actors.envs.kernels import KernelSettings
from vllm_actors.envs.other_tools import OtherTools
from vllm_actors.envs.parsers import (
    LOG_LEVELS,
    KernelChoice,
    choice,
    fused_quant_mode,
    integer,
    kernel_choice,
    log_level,
    number,
    parse_bool,
    positive_number,
    profile_window,
    text,
)
from vllm_actors.envs.process import ProcessSettings
from vllm_actors.envs.setting import GROUPS, Setting, T, kernel_switch, switch
from vllm_actors.envs.tensor_parallel import TensorParallelSettings

__all__ = [
    "GROUPS", "LOG_LEVELS", "REMOVED", "Envs", "KernelChoice", "Setting", "T", "choice", "envs", "fused_quant_mode",
    "integer", "kernel_choice", "kernel_switch", "log_level", "number", "parse_bool", "positive_number",
    "profile_window", "switch", "text",
]


class Envs(ProcessSettings, EngineSettings, KernelSettings, TensorParallelSettings, DeprecatedAliases, OtherTools):
    """The settings, read from ``environ`` (None: this process's environment, at every read)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    @classmethod
    def settings(cls) -> Iterator[Setting[Any]]:
        """Every setting, group by group in the order of ``GROUPS``, each group's as declared."""
        for group in cls.__mro__:
            for value in vars(group).values():
                if isinstance(value, Setting):
                    yield value

    @classmethod
    def setting(cls, name: str) -> Setting[Any]:
        found = getattr(cls, name, None)  # a Setting read on the class is the Setting itself
        if not isinstance(found, Setting):
            raise KeyError(f"{name} is not a registered setting (vllm_actors/envs/__init__.py)")
        return found

    def is_set(self, name: str) -> bool:
        """Whether ``name`` holds a value here (an empty one counts as unset unless it means something)."""
        raw = self.environ.get(self.setting(name).name)
        return raw is not None and (self.setting(name).keep_empty or bool(raw.strip()))


envs = Envs()

# Former settings, now constants in the code (their measurements: benchmarks/RESULTS.md).
REMOVED = {
    "VLLM_ACTORS_GEMV_BLOCK_N": "`kernels/gemv.py` `GemvConfig.block_n` (8)",
    "VLLM_ACTORS_GEMV_BLOCK_K": "`kernels/gemv.py` `GemvConfig.block_k` (1024)",
    "VLLM_ACTORS_GEMV_WARPS": "`kernels/gemv.py` `GemvConfig.warps` (4)",
    "VLLM_ACTORS_GEMV_STAGES": "`kernels/gemv.py` `GemvConfig.stages` (2)",
    "VLLM_ACTORS_GEMV_PREFETCH": "`kernels/gemv.py` `GemvConfig.prefetch` (2)",
    "VLLM_ACTORS_DECODE_BLOCK_N": "`kernels/triton_decode.py` `DECODE_BLOCK_N` (128)",
    "VLLM_ACTORS_DECODE_WAVES": "`kernels/decode_splits.py` `DECODE_WAVES` (2)",
    "VLLM_ACTORS_DECODE_ORDER": "`kernels/triton_decode.py` `DECODE_ORDERED` (longest context first)",
    "VLLM_ACTORS_DECODE_MAX_SPLITS": "`kernels/decode_splits.py` `DECODE_MAX_SPLITS` (64)",
    "VLLM_ACTORS_TP_SYMM_MAX_BYTES": "`models/parallel.py` `SYMM_MAX_BYTES` (8 MiB)",
    "VLLM_ACTORS_TP_FUSED_NORM_MAX_BYTES": "`models/fused_all_reduce.py` `FUSED_MAX_BYTES` (8 MiB)",
}
