"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.test_throughput_bench import TINY_QWEN3_CONFIG


@pytest.fixture
def tiny_qwen3_config_dir(tmp_path: Path) -> Path:
    """A Hugging Face directory holding only config.json: for load_format="dummy"."""
    path = tmp_path / "tiny-qwen3"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG))
    return path
