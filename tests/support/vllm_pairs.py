"""Pinned vLLM request/response pairs: load them from ``tests/http/vllm_pairs/*.json`` and check one
against a running server (``tests/http/test_vllm_pairs.py`` starts the servers and runs them all).

A file is one JSON object; every key but ``pairs`` is optional::

    {
      "about": "what these pairs pin, and where in vLLM 0.26 they come from",
      "model": "tiny_qwen3",                  # a session fixture of tests/conftest.py naming a checkpoint
      "serve_args": ["--reasoning-parser", "qwen3"],   # extra ``vllm-actors serve`` flags
      "env": {"VLLM_SERVER_DEV_MODE": "1"},   # extra environment of the server process
      "module": "test_responses_api",         # run by that test module on its own server, not here
      "adapters": {                           # PEFT LoRA adapters the session builds (see build_adapters)
        "good": {"rank": 8, "seed": 1},       # of the file's model (or "model": another fixture; "targets")
        "big": {"from": "good", "config": {"r": 1024}},   # a copy, its adapter_config.json updated
        "bare": {"from": "good", "remove": ["adapter_model.safetensors"]},
        "junk": {"files": {"adapter_config.json": "not json"}}   # a directory of these files only
      },
      "pairs": [
        {
          "name": "chat-reasoning-split",     # unique in the file: the test id is "<file stem>:<name>"
          "source": "vllm tests/entrypoints/openai/test_chat_with_reasoning.py",   # free text
          "method": "POST",                   # default POST (GET sends no body)
          "path": "/v1/chat/completions",
          "headers": {"X-Request-Id": "abc"}, # optional request headers
          "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
          "status": 200,                      # the expected HTTP status
          "expect": [                         # checks, all must hold
            {"pointer": "/choices/0/message/content", "equals": null},
            {"pointer": "/choices/0/message/reasoning", "type": "string"},
            {"pointer": "/id", "regex": "^chatcmpl-"},
            {"pointer": "/choices/0/message/tool_calls", "absent": true},
            {"pointer": "/events", "join": "/choices/0/delta/reasoning", "regex": "."},
            {"header": "x-request-id", "equals": "abc"}
          ]
        }
      ]
    }

The served model name is always ``tiny``. In serve_args, bodies and expected values, ``{adapter:NAME}``
becomes the built adapter's path and ``{model}`` the checkpoint's path. ``pointer`` is an RFC 6901 JSON pointer into the
response's JSON body; a streamed response (``text/event-stream``) becomes ``{"events": [...], "done":
bool}``: the ``data:`` payloads decoded, in order, and whether ``[DONE]`` closed the stream. A check
holds one test: ``equals`` (a JSON value), ``type`` (``string``, ``number``, ``integer``, ``boolean``,
``null``, ``array``, ``object``), ``regex`` (``re.search`` on a string), ``absent`` (the pointer
resolves to nothing), ``length`` (of an array, string or object). ``join`` (with a pointer to an array)
first concatenates, over the array's items, the strings found at the ``join`` pointer inside each
(missing or null ones skipped): what a client rebuilds from stream deltas. ``header`` checks a
response header (lower-case name) instead of the body.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

PAIRS_DIR = Path(__file__).resolve().parent.parent / "http" / "vllm_pairs"
SERVED_NAME = "tiny"
_MISSING = object()
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,), "null": (type(None),),
    "array": (list,), "object": (dict,),
}
_CHECKS = ("equals", "type", "regex", "absent", "length")


@dataclass(frozen=True)
class ServerSpec:
    """What a server for a file's pairs is started with: pairs with the same spec share one server."""

    model: str = "tiny_qwen3"
    serve_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    adapters: tuple[tuple[str, str], ...] = ()  # (name, its recipe as JSON)


@dataclass(frozen=True)
class Pair:
    file: str
    name: str
    path: str
    spec: ServerSpec
    method: str = "POST"
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 200
    expect: tuple[dict[str, Any], ...] = ()

    @property
    def id(self) -> str:
        return f"{self.file}:{self.name}"


def load_pairs(directory: Path = PAIRS_DIR, module: str | None = None) -> list[Pair]:
    """The pairs of every file whose ``module`` is ``module`` (None: the files tests/http/test_vllm_pairs.py
    runs), files in name order; a malformed file is a ValueError naming it. A module that already
    starts a server with the flags its pairs need runs its own file, saving a server start."""
    pairs: list[Pair] = []
    for path in sorted(directory.glob("*.json")):
        try:
            document = json.loads(path.read_text())
            if document.get("module") != module:
                continue
            spec = ServerSpec(model=document.get("model", "tiny_qwen3"),
                              serve_args=tuple(document.get("serve_args", ())),
                              env=tuple(sorted(document.get("env", {}).items())),
                              adapters=tuple((name, json.dumps(recipe, sort_keys=True))
                                             for name, recipe in document.get("adapters", {}).items()))
            names: set[str] = set()
            for raw in document["pairs"]:
                unknown = set(raw) - {"name", "source", "method", "path", "headers", "body", "status", "expect"}
                if unknown:
                    raise ValueError(f"unknown keys {sorted(unknown)} in pair {raw.get('name')!r}")
                if raw["name"] in names:
                    raise ValueError(f"pair name {raw['name']!r} appears twice")
                names.add(raw["name"])
                for check in raw.get("expect", ()):
                    _validate_check(check)
                pairs.append(Pair(file=path.stem, name=raw["name"], path=raw["path"], spec=spec,
                                  method=raw.get("method", "POST").upper(), body=raw.get("body"),
                                  headers=dict(raw.get("headers", {})), status=int(raw.get("status", 200)),
                                  expect=tuple(raw.get("expect", ()))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path.name}: {exc!r}") from exc
    return pairs


def _validate_check(check: dict[str, Any]) -> None:
    if ("pointer" in check) == ("header" in check):
        raise ValueError(f"a check needs exactly one of pointer or header: {check}")
    if sum(key in check for key in _CHECKS) != 1:
        raise ValueError(f"a check needs exactly one of {_CHECKS}: {check}")
    if "type" in check and check["type"] not in _TYPES:
        raise ValueError(f"unknown type {check['type']!r}; allowed: {sorted(_TYPES)}")


def resolve(document: Any, pointer: str) -> Any:
    """The value at an RFC 6901 pointer, or ``_MISSING``."""
    if pointer == "":
        return document
    if not pointer.startswith("/"):
        raise ValueError(f"a JSON pointer starts with '/': {pointer!r}")
    value = document
    for raw in pointer[1:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return _MISSING
    return value


def response_document(response: httpx.Response) -> Any:
    """The JSON body, or for an event stream its decoded ``data:`` payloads (see the module doc)."""
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events: list[Any] = []
        done = False
        for line in response.text.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    done = True
                else:
                    events.append(json.loads(payload))
        return {"events": events, "done": done}
    try:
        return response.json()
    except ValueError:
        return response.text


def failed_checks(pair: Pair, response: httpx.Response) -> list[str]:
    """What of the pair's expectation the response misses (empty: it matches)."""
    failures: list[str] = []
    if response.status_code != pair.status:
        return [f"status {response.status_code}, expected {pair.status}: {response.text[:500]}"]
    document = response_document(response)
    for check in pair.expect:
        if "header" in check:
            value: Any = response.headers.get(check["header"], _MISSING)
            where = f"header {check['header']}"
        else:
            value = resolve(document, check["pointer"])
            where = check["pointer"]
            if "join" in check and isinstance(value, list):
                pieces = [resolve(item, check["join"]) for item in value]
                value = "".join(p for p in pieces if isinstance(p, str))
                where = f"{where} joined at {check['join']}"
        problem = _check(value, check)
        if problem:
            failures.append(f"{where}: {problem}")
    return failures


def _check(value: Any, check: dict[str, Any]) -> str | None:
    if "absent" in check:
        return None if (value is _MISSING) == bool(check["absent"]) else f"absent={check['absent']}, got {value!r}"
    if value is _MISSING:
        return "missing"
    if "equals" in check:
        expected = check["equals"]
        same = value == expected and isinstance(value, bool) == isinstance(expected, bool)  # 1 is not true
        return None if same else f"expected {expected!r}, got {value!r}"
    if "type" in check:
        kinds = _TYPES[check["type"]]
        ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
        return None if ok else f"expected a {check['type']}, got {value!r}"
    if "regex" in check:
        ok = isinstance(value, str) and re.search(check["regex"], value) is not None
        return None if ok else f"expected a match of {check['regex']!r}, got {value!r}"
    ok = isinstance(value, (list, str, dict)) and len(value) == check["length"]
    return None if ok else f"expected length {check['length']}, got {value!r}"


def build_adapters(spec: ServerSpec, root: Path, checkpoint: Callable[[str], Path]) -> dict[str, str]:
    """Build the spec's adapters under ``root`` (in file order: a ``from`` names an earlier one);
    the placeholders' values. ``checkpoint`` maps a fixture name to its checkpoint's path."""
    from tests.support.lora_adapters import ALL_TARGETS, build_adapter

    values = {"{model}": str(checkpoint(spec.model))}
    for name, text in spec.adapters:
        recipe, out = json.loads(text), root / name
        unknown = set(recipe) - {"model", "targets", "rank", "seed", "from", "config", "remove", "files"}
        if unknown:
            raise ValueError(f"adapter {name!r}: unknown keys {sorted(unknown)}")
        if "files" in recipe:
            out.mkdir(parents=True)
            for file, content in recipe["files"].items():
                (out / file).write_text(content)
        elif "from" in recipe:
            shutil.copytree(values[f"{{adapter:{recipe['from']}}}"], out)
        else:
            build_adapter(checkpoint(recipe.get("model", spec.model)), out,
                          targets=tuple(recipe.get("targets", ALL_TARGETS)), rank=recipe.get("rank", 8),
                          seed=recipe.get("seed", 1))
        if "config" in recipe:
            config_path = out / "adapter_config.json"
            config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **recipe["config"]}))
        for file in recipe.get("remove", ()):
            (out / file).unlink()
        values[f"{{adapter:{name}}}"] = str(out)
    return values


def substitute(value: Any, values: dict[str, str]) -> Any:
    """``value`` with every placeholder in its strings (keys and items, nested) replaced."""
    if isinstance(value, str):
        for placeholder, text in values.items():
            value = value.replace(placeholder, text)
        return value
    if isinstance(value, list):
        return [substitute(item, values) for item in value]
    if isinstance(value, dict):
        return {substitute(key, values): substitute(item, values) for key, item in value.items()}
    return value


def run_pair(base_url: str, pair: Pair, timeout: float = 300.0, values: dict[str, str] | None = None) -> list[str]:
    """Send the pair's request to the server at ``base_url`` (placeholders replaced by ``values``);
    the failed checks."""
    if values:
        pair = replace(pair, body=substitute(pair.body, values), expect=tuple(substitute(list(pair.expect), values)))
    response = httpx.request(pair.method, f"{base_url}{pair.path}", headers=pair.headers,
                             json=pair.body if pair.method != "GET" else None, timeout=timeout)
    return failed_checks(pair, response)
