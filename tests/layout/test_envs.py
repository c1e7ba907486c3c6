"""The registry of settings read from the environment (src/vllm_actors/envs/): typed reads,
parsed when read, clear errors; its generated table in docs/settings.md; the deprecated aliases of
engine arguments; the one "Triton or torch" decision."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vllm_actors.engine_args import make_engine_config
from vllm_actors.envs import REMOVED, Envs, envs
from vllm_actors.envs.table import markdown
from vllm_actors.kernels.choice import KERNEL_CHOICES, use_triton
from vllm_actors.protocol.config import EngineConfig, resolve_scheduler_config

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_PAGE = ROOT / "docs" / "settings.md"
NOT_YET_CONVERTED = ("src/vllm_actors/bench/",)  # the benchmarks' own tools (tests/test_layout.py's list)


def test_the_settings_page_is_generated_from_the_registry() -> None:
    assert SETTINGS_PAGE.exists() and SETTINGS_PAGE.read_text() == markdown(), (
        "docs/settings.md is out of date: run `python -m vllm_actors.envs --markdown > docs/settings.md`")


def test_every_variable_named_in_the_source_is_registered() -> None:
    registered = {setting.name for setting in Envs.settings()}
    unknown = []
    for path in sorted((ROOT / "src" / "vllm_actors").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("src/vllm_actors/envs/") or relative.startswith(NOT_YET_CONVERTED):
            continue
        for name in set(re.findall(r"VLLM_ACTORS_[A-Z0-9_]*[A-Z0-9]", path.read_text())):
            if name not in registered:
                unknown.append(f"{relative}: {name}")
    assert not unknown, "declare these in src/vllm_actors/envs/__init__.py (or drop them): " + ", ".join(unknown)
    assert not registered & REMOVED.keys()


def test_reads_follow_the_environment_without_a_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ACTORS_LOG_RATE", raising=False)
    assert envs.VLLM_ACTORS_LOG_RATE == 10
    monkeypatch.setenv("VLLM_ACTORS_LOG_RATE", "3")
    assert envs.VLLM_ACTORS_LOG_RATE == 3
    monkeypatch.setenv("VLLM_ACTORS_LOG_RATE", " ")  # empty counts as unset
    assert envs.VLLM_ACTORS_LOG_RATE == 10
    monkeypatch.setenv("VLLM_ACTORS_LOG_LEVEL", "debug")
    assert envs.VLLM_ACTORS_LOG_LEVEL == "DEBUG"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("VLLM_ACTORS_LOG_RATE", "fast", "VLLM_ACTORS_LOG_RATE must be a whole number >= 0, got 'fast'"),
    ("VLLM_ACTORS_LOG_LEVEL", "loud", "VLLM_ACTORS_LOG_LEVEL must be a logging level"),
    ("VLLM_ACTORS_GC_FREEZE", "maybe", "VLLM_ACTORS_GC_FREEZE must be 0 or 1"),
    ("VLLM_ACTORS_STEPS_IN_FLIGHT", "0", "VLLM_ACTORS_STEPS_IN_FLIGHT must be a whole number >= 1"),
    ("VLLM_ACTORS_ATTENTION", "flash", "VLLM_ACTORS_ATTENTION must be one of torch, triton, auto"),
    ("VLLM_ACTORS_PROFILE_STEPS", "7", "VLLM_ACTORS_PROFILE_STEPS must be FIRST:COUNT"),
    ("VLLM_ACTORS_CPU_KVCACHE_SPACE", "-1", "VLLM_ACTORS_CPU_KVCACHE_SPACE must be a number > 0"),
])
def test_a_bad_value_is_an_error_naming_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(Envs({name: value}), name)


def test_values_are_typed() -> None:
    settings = Envs({"VLLM_ACTORS_GC_FREEZE": "off", "VLLM_ACTORS_PDL": "TRUE", "VLLM_ACTORS_PROFILE_STEPS": "200:8",
                     "VLLM_ACTORS_BUSY_POLL_MS": "2.5", "CUDA_VISIBLE_DEVICES": ""})
    assert settings.VLLM_ACTORS_GC_FREEZE is False and settings.VLLM_ACTORS_PDL is True
    assert settings.VLLM_ACTORS_PROFILE_STEPS == (200, 8)
    assert settings.VLLM_ACTORS_BUSY_POLL_MS == 2.5
    assert settings.CUDA_VISIBLE_DEVICES == ""  # means something: every GPU hidden
    assert Envs({}).CUDA_VISIBLE_DEVICES is None and Envs({}).VLLM_ACTORS_WORKER_THREADS is None
    assert Envs({"VLLM_ACTORS_PDL": ""}).is_set("VLLM_ACTORS_PDL") is False
    with pytest.raises(KeyError, match="not a registered setting"):
        Envs({}).is_set("VLLM_ACTORS_NO_SUCH_THING")


def test_every_setting_has_a_doc_line_and_its_default_parses_back() -> None:
    for setting in Envs.settings():
        assert setting.doc.endswith(".") and "\n" not in setting.doc, setting.name
        assert setting.read({}) == setting.default


def test_the_deprecated_aliases_fill_the_engine_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_ACTORS_STEPS_IN_FLIGHT", "VLLM_ACTORS_DISABLE_EVENTS", "VLLM_ACTORS_CHECK_INVARIANTS",
                 "VLLM_ACTORS_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)
    plain = make_engine_config("m", {})
    assert (plain.steps_in_flight, plain.disable_events, plain.check_invariants, plain.cpu_kv_cache_gib) == (
        2, False, False, None)
    monkeypatch.setenv("VLLM_ACTORS_STEPS_IN_FLIGHT", "1")
    monkeypatch.setenv("VLLM_ACTORS_DISABLE_EVENTS", "1")
    monkeypatch.setenv("VLLM_ACTORS_CHECK_INVARIANTS", "1")
    monkeypatch.setenv("VLLM_ACTORS_CPU_KVCACHE_SPACE", "0.5")
    aliased = make_engine_config("m", {})
    assert (aliased.steps_in_flight, aliased.disable_events, aliased.check_invariants) == (1, True, True)
    assert aliased.resolved_cpu_kv_cache_bytes() == 1 << 29
    given = make_engine_config("m", {"steps_in_flight": 3, "check_invariants": False, "cpu_kv_cache_gib": 2.0})
    assert (given.steps_in_flight, given.check_invariants, given.cpu_kv_cache_gib) == (3, False, 2.0)  # given wins


def test_steps_in_flight_reaches_the_scheduler_config() -> None:
    for depth in (1, 3):
        config = EngineConfig(model="m", steps_in_flight=depth)
        assert resolve_scheduler_config(config, 512, 100).max_steps_in_flight == depth
    assert resolve_scheduler_config(EngineConfig(model="m", steps_in_flight=3, async_scheduling=False), 512,
                                    100).max_steps_in_flight == 1
    with pytest.raises(ValueError, match="steps_in_flight must be a positive integer"):
        EngineConfig(model="m", steps_in_flight=0)


@pytest.mark.parametrize("variable", KERNEL_CHOICES)
def test_one_triton_or_torch_decision(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(variable, raising=False)
    assert use_triton(variable, True, cuda) and not use_triton(variable, True, cpu)
    assert not use_triton(variable, False, cuda)  # never without triton
    monkeypatch.setenv(variable, "triton")
    assert use_triton(variable, True, cpu) and not use_triton(variable, False, cpu)
    monkeypatch.setenv(variable, "Torch")
    assert not use_triton(variable, True, cuda)
    monkeypatch.setenv(variable, "fast")
    with pytest.raises(ValueError, match=variable):
        use_triton(variable, True, cuda)
    with pytest.raises(KeyError):
        use_triton("VLLM_ACTORS_GEMV", True, cuda)  # a switch, not a kernel choice
