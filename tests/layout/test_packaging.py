"""The wheel holds every module of the source tree: packages are found under src/ (pyproject.toml's
``packages.find``), which skips a folder without ``__init__.py``; an editable install would hide that
(the GPU machine installs the project as a wheel)."""

from __future__ import annotations

from pathlib import Path

import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def test_packages_are_found_under_src() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["packages"]["find"]["where"] == ["src"]


def test_every_module_folder_is_a_found_package() -> None:
    found = set(find_packages(str(SRC)))
    folders = {path.parent for path in (SRC / "vllm_actors").rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(".".join(folder.relative_to(SRC).parts) for folder in folders)
    missing = [name for name in missing if name not in found]
    assert not missing, f"folders with modules but no __init__.py (left out of the wheel): {missing}"
