"""Structured outputs on the HTTP surface, in vLLM's spellings: ``response_format`` (``text``,
``json_object``, ``json_schema`` with ``{"name", "schema", "strict"}``) on both endpoints, vLLM's
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and its
older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. They become
one ``StructuredOutputs``; setting two kinds is a 400 (vLLM: "You can only use one kind of
structured outputs constraint"). The spec itself is checked by the frontend
(``actors/frontend/structured.py``: a bad schema, regex or grammar is a 400 naming the field)."""

from __future__ import annotations

import json
from typing import Any

from vllm_actors.protocol.sampling import StructuredOutputs
from vllm_actors.server.errors import bad_request
from vllm_actors.server.protocol import _SamplingFields

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's other StructuredOutputsParams keys: accepted at their neutral value; whitespace is always
# compact here (as with disable_any_whitespace), so that flag is accepted either way.
NEUTRAL_KEYS: dict[str, tuple[Any, ...]] = {
    "disable_any_whitespace": (True, False, None), "disable_fallback": (True, False, None),
    "disable_additional_properties": (False, None), "whitespace_pattern": (None,), "structural_tag": (None,),
}


def structured_outputs_of(body: _SamplingFields) -> StructuredOutputs | None:
    """The request's constraint (None when it has none); a 400 naming the field otherwise."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _vllm_object(body.structured_outputs)))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", {kind: value}))
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", _response_format(response_format)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"structured_outputs: you can only use one kind of structured outputs constraint, got "
                          f"{names}", found[1][0])
    name, fields = found[0]
    kinds = [kind for kind in KINDS if fields.get(kind) not in (None, False)]
    if len(kinds) != 1:
        raise bad_request(f"{name}: set exactly one of {', '.join(KINDS)}; got {kinds or 'none'}", name)
    kind = kinds[0]
    value = fields[kind]
    if kind == "json" and not isinstance(value, str):
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{name}: json must be a JSON schema (an object, or its text), got {value!r}"[:500], name)
        value = json.dumps(value, ensure_ascii=False)
    if kind in ("regex", "grammar", "json") and not isinstance(value, str):
        raise bad_request(f"{name}: {kind} must be a string, got {value!r}"[:500], name)
    if kind == "json_object" and value is not True:
        raise bad_request(f"{name}: json_object must be true or left out, got {value!r}"[:500], name)
    try:
        return StructuredOutputs(**{kind: value})
    except (ValueError, TypeError) as error:
        raise bad_request(f"{name}: {error}"[:500], name) from None


def _vllm_object(raw: dict[str, Any]) -> dict[str, Any]:
    for key, value in raw.items():
        if key in KINDS:
            continue
        if key not in NEUTRAL_KEYS:
            raise bad_request(f"structured_outputs: unknown key {key!r} (known: {', '.join(KINDS)})"[:500],
                              "structured_outputs")
        if not any(value is neutral or value == neutral for neutral in NEUTRAL_KEYS[key]):
            raise bad_request(f"structured_outputs.{key}: not supported by this server; got {value!r}"[:500],
                              "structured_outputs")
    return raw


def _response_format(response_format: Any) -> dict[str, Any]:
    kind = response_format.type
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.json_schema
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise bad_request("response_format: json_schema.schema is required for type \"json_schema\"",
                              "response_format")
        return {"json": schema}
    raise bad_request(f"response_format: type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}"
                      [:500], "response_format")
