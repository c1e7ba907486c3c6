"""The wheel holds every package of the source tree (an editable install hides a package missing from
pyproject.toml's explicit list: the GPU machine installs the project as a wheel)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _source_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in config["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base).parts
            found.add(".".join((name, *relative)))
    return found


def test_every_source_package_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    missing = _source_packages() - set(config["packages"])
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {sorted(missing)}"
