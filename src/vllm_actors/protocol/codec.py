"""Encoding and strict decoding of messages (msgpack on the wire, JSON Schema for the docs)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from vllm_actors.protocol.messages import ALL_MESSAGES, PROTOCOL_VERSION, Message


class MessageCodec:
    """Encodes any ``Message``; decodes bytes strictly into the tagged union or raises
    ``msgspec.DecodeError`` / ``msgspec.ValidationError`` (callers log and drop the frame)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> Message:
        return self._decoder.decode(data)


def _schema(title: str, types: tuple[type, ...]) -> dict[str, Any]:
    schemas, components = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "protocol_version": PROTOCOL_VERSION,
        "oneOf": schemas,
        "$defs": components,
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
