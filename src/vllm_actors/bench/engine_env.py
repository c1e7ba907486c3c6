"""Settings the throughput benchmark gives our engine's processes for its run only: ``--engine-env
NAME=VALUE`` (any registered ``VLLM_ACTORS_*`` setting, checked by its own parser) and the ones its
options stand for (``--moe-router-skew``, ``--moe-config``). The actors inherit this process's
environment as they start; the earlier values come back after the run."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from vllm_actors.envs import Envs, envs


def engine_env_arg(text: str) -> tuple[str, str]:
    """``--engine-env``'s value: ``NAME=VALUE`` of a registered setting whose value it parses."""
    name, equals, value = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        Envs.setting(name).read({name: value})
    except (KeyError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc).strip("'\"")) from None
    return name, value


@contextmanager
def engine_environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs, the earlier values (or none) after."""
    saved = {name: envs.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
