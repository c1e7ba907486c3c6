"""Encoding and strict decoding of messages (msgpack on the wire, JSON Schema for the docs)."""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any, Union

import msgspec

from vllm_actors.protocol.messages import ALL_MESSAGES, PROTOCOL_VERSION, Message, PassThroughPlan, StepPlan
from vllm_actors.protocol.names import KV_CACHE_MANAGER

# The message types an actor decodes as a view (``messages``, "decode views"), by actor name.
DECODE_VIEWS: dict[str, dict[type, type]] = {KV_CACHE_MANAGER: {StepPlan: PassThroughPlan}}


class MessageCodec:
    """Encodes any ``Message``; decodes bytes strictly into the tagged union or raises
    ``msgspec.DecodeError`` / ``msgspec.ValidationError`` (callers log and drop the frame).
    ``views`` replaces message types of the union by views of the same wire format."""

    def __init__(self, views: Mapping[type, type] | None = None) -> None:
        views = dict(views or {})
        self._encoder = msgspec.msgpack.Encoder()
        union: Any = Union[tuple(views.get(kind, kind) for kind in ALL_MESSAGES)]  # noqa: UP007 - built at run time
        self._decoder = msgspec.msgpack.Decoder(union)
        self._protocol_type = {view: kind for kind, view in views.items()}

    @classmethod
    def for_actor(cls, name: str) -> MessageCodec:
        """The codec an actor (by name or role) receives with."""
        return cls(DECODE_VIEWS.get(name))

    def protocol_type(self, message: Any) -> type:
        """The protocol type of a decoded message (a view's is the type it stands for)."""
        return self._protocol_type.get(type(message), type(message))

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Message:
        return self._decoder.decode(data)


def _cleaned(node: Any) -> Any:
    """Every ``description`` in a schema as ``inspect.cleandoc`` leaves a docstring (msgspec 0.23 does
    so itself, earlier versions kept the indentation): the same exported text under either."""
    if isinstance(node, dict):
        return {key: inspect.cleandoc(value) if key == "description" and isinstance(value, str) else _cleaned(value)
                for key, value in node.items()}
    if isinstance(node, list):
        return [_cleaned(item) for item in node]
    return node


def _schema(title: str, types: tuple[type, ...]) -> dict[str, Any]:
    schemas, components = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "protocol_version": PROTOCOL_VERSION,
        "oneOf": _cleaned(list(schemas)),
        "$defs": _cleaned(components),
    }


def json_schemas() -> dict[str, dict[str, Any]]:
    """Every wire schema, by the file name it is exported to under ``protocols/``."""
    from vllm_actors.protocol.events import EventBatch
    from vllm_actors.protocol.metrics import ALL_QUERIES, ALL_REPLIES

    return {
        "messages.schema.json": _schema("vllm_actors messages", ALL_MESSAGES),
        "events.schema.json": _schema("vllm_actors event batches", (EventBatch,)),
        "metrics.schema.json": _schema("vllm_actors metrics queries and replies", ALL_QUERIES + ALL_REPLIES),
    }


def json_schema_texts() -> dict[str, str]:
    return {name: json.dumps(schema, indent=2, sort_keys=True) + "\n" for name, schema in json_schemas().items()}
