"""Every long-running process freezes its start-up heap (runtime/gc_tuning.py): in its own
interpreter here, so that pytest's own collector is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import gc, json
from vllm_actors.runtime.gc_tuning import freeze_startup_heap
before = gc.get_threshold()
freeze_startup_heap()
print(json.dumps({"frozen": gc.get_freeze_count(), "before": before, "after": gc.get_threshold()}))
"""


def probe(**env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120,
                          env={**os.environ, **env})
    return json.loads(done.stdout)


def test_the_start_up_heap_is_frozen_and_the_young_threshold_raised() -> None:
    from vllm_actors.runtime.gc_tuning import YOUNG_THRESHOLD

    result = probe()
    assert result["frozen"] > 1000  # the interpreter's and the project's modules at least
    assert result["after"] == [YOUNG_THRESHOLD, *result["before"][1:]]


@pytest.mark.parametrize("value", ["0", " 0 "])
def test_it_can_be_turned_off(value: str) -> None:
    result = probe(VLLM_ACTORS_GC_FREEZE=value)
    assert result["frozen"] == 0 and result["after"] == result["before"]
