"""Pinned request/response pairs from vLLM 0.26's documentation and tests, each sent to a real
``vllm-actors serve`` on a tiny model (format: tests/support/vllm_pairs.py). Pairs of the same
server spec (model, flags, environment, adapters) share one server, started once; a new spec stops
the last. A spec's adapters are built before its server starts; placeholders name their paths."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server_helpers import free_port, start_server, stop_process, wait_healthy
from tests.support.vllm_pairs import (
    SERVED_NAME,
    Pair,
    ServerSpec,
    build_adapters,
    failed_checks,
    load_pairs,
    run_pair,
    substitute,
)

PAIRS = load_pairs()
Served = tuple[str, dict[str, str]]  # a server's base URL, and its placeholders' values


@pytest.fixture(scope="module")
def server_for(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[ServerSpec], Served]]:
    """The base URL of a server for a spec and its placeholders' values; one server at a time (the
    pairs come grouped by file)."""
    current: dict[ServerSpec, Served] = {}
    running: list[subprocess.Popen[bytes]] = []

    def url(spec: ServerSpec) -> Served:
        if spec in current:
            return current[spec]
        for process in running:
            stop_process(process)
        running.clear()
        current.clear()
        model: Path = request.getfixturevalue(spec.model)
        tmp = tmp_path_factory.mktemp("vllm_pairs")
        values = build_adapters(spec, tmp / "adapters", request.getfixturevalue)
        port, log_path = free_port(), tmp / "server.log"
        with pytest.MonkeyPatch.context() as patch:
            for name, value in spec.env:
                patch.setenv(name, value)
            process = start_server(model, port, log_path, tmp / "runs", "--served-model-name", SERVED_NAME,
                                   "--max-model-len", "512", "--num-gpu-blocks-override", "128",
                                   *substitute(list(spec.serve_args), values))
        running.append(process)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process, log_path)
        current[spec] = (base, values)
        return current[spec]

    try:
        yield url
    finally:
        for process in running:
            stop_process(process)


@pytest.mark.parametrize("pair", PAIRS, ids=[p.id for p in PAIRS])
def test_vllm_pair(pair: Pair, server_for: Callable[[ServerSpec], Served]) -> None:
    base, values = server_for(pair.spec)
    failures = run_pair(base, pair, values=values)
    assert not failures, "\n".join(failures)


def test_the_runner_reports_what_differs() -> None:
    """The checks can fail: each kind names the pointer and what it found."""
    spec = ServerSpec()
    expect = ({"pointer": "/a", "equals": 1}, {"pointer": "/b", "type": "string"}, {"pointer": "/c", "absent": True},
              {"pointer": "/events", "join": "/d", "equals": "xy"}, {"header": "x-k", "regex": "^v$"})
    pair = Pair(file="f", name="n", path="/p", spec=spec, expect=expect)
    good = httpx.Response(200, json={"a": 1, "b": "s", "events": [{"d": "x"}, {}, {"d": "y"}]}, headers={"x-k": "v"})
    assert failed_checks(pair, good) == []
    bad = httpx.Response(200, json={"a": True, "b": 2, "c": None, "events": [{"d": "x"}]})
    wrong = [f.split(":")[0] for f in failed_checks(pair, bad)]
    assert wrong == ["/a", "/b", "/c", "/events joined at /d", "header x-k"]
    assert failed_checks(pair, httpx.Response(500, text="boom"))[0].startswith("status 500")
