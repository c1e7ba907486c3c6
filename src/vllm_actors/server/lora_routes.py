"""LoRA adapters served as model names (vLLM's): ``--lora-modules`` at start, and with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` at run time. A request whose ``model`` names an adapter runs with it;
``/v1/models`` lists each adapter with the base model as its ``parent``.

An adapter's engine id is derived from its name and path (the same in every API process of a
server), so no two adapters share an id, and the prefix cache keeps their blocks apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from vllm_actors.envs import envs
from vllm_actors.lora.adapter import AdapterNotFoundError
from vllm_actors.lora.check import AdapterCheck
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.lora import LoRARequest
from vllm_actors.server.errors import OpenAIError, bad_request
from vllm_actors.server.protocol import ModelCard


def lora_check(client: Any) -> AdapterCheck:
    """The adapter check of a client's engine (its group's config; LoRA off when it has none)."""
    config = getattr(getattr(client, "group", None), "config", None)
    if isinstance(config, EngineConfig):
        return AdapterCheck.of(config)
    return AdapterCheck(False, 0, client.model)


class LoRAModule(msgspec.Struct, kw_only=True):
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModule]:
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                modules.append(msgspec.json.decode(value, type=LoRAModule))
            except msgspec.DecodeError as error:
                raise ValueError(f"--lora-modules {value}: not a JSON object with name and path ({error})") from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
        modules.append(LoRAModule(name=name, path=path))
    return modules


def adapter_id(name: str, path: str) -> int:
    """The engine's id of adapter ``name`` at ``path``: 1 .. 2**31 - 1, from a hash of both."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (2**31 - 1)


class ServedAdapters:
    """The adapters a server routes to by model name."""

    def __init__(self, check: AdapterCheck, modules: list[LoRAModule]) -> None:
        self.check = check
        self.by_name: dict[str, LoRARequest] = {}
        for module in modules:
            self.add(module.name, module.path)

    def get(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model is not None else None

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the base model and serve it (ValueError: nothing changed)."""
        if name in self.by_name:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        lora = LoRARequest(name, adapter_id(name, path), path)
        self.check(lora)
        self.by_name[name] = lora
        return lora

    def cards(self, base: str, created: int) -> list[ModelCard]:
        return [ModelCard(id=name, created=created, root=lora.lora_path, parent=base)
                for name, lora in self.by_name.items()]


async def _json_body(request: Request) -> dict[str, object]:
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as error:
        raise bad_request(f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def add_lora_routes(app: FastAPI, adapters: ServedAdapters) -> None:
    """The run-time endpoints, registered only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set."""
    if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await _json_body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        try:
            adapters.add(name, path)
        except AdapterNotFoundError:  # vLLM's 404 and words for a path with no adapter
            raise OpenAIError(f"Loading lora {name} failed: No adapter found for {path}", 404,
                              param="lora_path") from None
        except ValueError as error:
            raise bad_request(str(error), "lora_path") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await _json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        if adapters.by_name.pop(name, None) is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
