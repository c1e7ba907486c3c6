"""A request's scheduling fields: vLLM's ``priority`` and the latency targets
``ttft_target_ms`` / ``e2e_target_ms`` (relative to arrival), with the server-wide defaults of
``--default-ttft-target-ms``, ``--default-e2e-target-ms`` and, per endpoint,
``--default-targets chat:ttft=200,e2e=5000``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.server.errors import bad_request
from vllm_actors.server.protocol import _SamplingFields

ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class Targets:
    ttft_ms: float | None = None
    e2e_ms: float | None = None


def parse_default_targets(specs: Sequence[str]) -> dict[str, Targets]:
    """``["chat:ttft=200,e2e=5000", "completions:e2e=60000"]`` -> targets per endpoint."""
    out: dict[str, Targets] = {}
    for spec in specs:
        endpoint, _, items = spec.partition(":")
        if endpoint not in ENDPOINTS or not items:
            raise ValueError(f"--default-targets: expected ENDPOINT:ttft=MS,e2e=MS with ENDPOINT one of "
                             f"{ENDPOINTS}, got {spec!r}")
        values: dict[str, float] = {}
        for item in items.split(","):
            key, _, value = item.partition("=")
            if key not in ("ttft", "e2e"):
                raise ValueError(f"--default-targets: unknown target {key!r} in {spec!r} (ttft, e2e)")
            values[key] = _positive(f"--default-targets {key}", float(value))
        out[endpoint] = Targets(values.get("ttft"), values.get("e2e"))
    return out


def _positive(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of milliseconds, got {value}")
    return value


def with_schedule(prepared: list[PreparedRequest], body: _SamplingFields, endpoint: str,
                  defaults: Mapping[str, Targets], default: Targets) -> list[PreparedRequest]:
    """The prepared requests with the body's priority and targets (else the endpoint's default,
    else the server's); a target that is not a positive number is a 400 naming the field."""
    fallback = defaults.get(endpoint, default)
    ttft, e2e = body.ttft_target_ms, body.e2e_target_ms
    for name, value in (("ttft_target_ms", ttft), ("e2e_target_ms", e2e)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise bad_request(f"{name}: must be a positive number of milliseconds, got {value}", name)
    ttft = ttft if ttft is not None else (fallback.ttft_ms if fallback.ttft_ms is not None else default.ttft_ms)
    e2e = e2e if e2e is not None else (fallback.e2e_ms if fallback.e2e_ms is not None else default.e2e_ms)
    if body.priority == 0 and ttft is None and e2e is None:
        return prepared
    return [dataclasses.replace(p, priority=body.priority, ttft_target_ms=ttft, e2e_target_ms=e2e)
            for p in prepared]
