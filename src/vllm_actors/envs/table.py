"""The reference table of every setting (docs/settings.md), and ``python -m vllm_actors.envs
[--markdown]``: the values this process would use, or that table."""

from __future__ import annotations

import sys

from vllm_actors.envs import GROUPS, REMOVED, Envs, envs


def markdown() -> str:
    """The reference table of every setting (docs/settings.md)."""
    lines = [
        "# Settings read from the environment",
        "",
        "Generated from `src/vllm_actors/envs/__init__.py` by",
        "`python -m vllm_actors.envs --markdown > docs/settings.md`; `tests/layout/test_envs.py` fails when this",
        "file is out of date. An empty value counts as unset (except `CUDA_VISIBLE_DEVICES`); a bad value",
        "stops the process with an error naming the variable.",
        "Booleans take 1/0, true/false, yes/no or on/off.",
    ]
    for group, title in GROUPS.items():
        lines += ["", f"## {title}", "", "| Variable | Type | Default | What it does |", "| --- | --- | --- | --- |"]
        lines += [f"| `{s.name}` | {s.kind} | {s.shown_default} | {s.doc} |"
                  for s in Envs.settings() if s.group == group]
    lines += ["", "## Removed: now constants in the code", "",
              "Their sweeps are done (`benchmarks/RESULTS.md`); setting them has no effect.", "",
              "| Variable | Now |", "| --- | --- |"]
    lines += [f"| `{name}` | {where} |" for name, where in REMOVED.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if args:
        sys.stderr.write("usage: python -m vllm_actors.envs [--markdown]\n")
        return 2
    for setting in Envs.settings():
        print(f"{setting.name}={getattr(envs, setting.name)!r}")
    return 0

